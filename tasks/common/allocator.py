"""The memory allocator a stage runs under: tcmalloc or jemalloc in LD_PRELOAD (`launch.preload_allocator`).

Ranks get it in their launcher's environment (tasks.common.launch); a local run re-executes itself
once with it, since LD_PRELOAD only acts when a process starts. This module knows allocators, not
launch configs: it takes the allocator's name (`Allocator`), and tasks.common.launch passes it on.
"""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Literal

from tasks.common.errors import UserError

log = logging.getLogger(__name__)

#: `launch.preload_allocator`: auto is tcmalloc, else jemalloc, when installed; none leaves LD_PRELOAD as it is
Allocator = Literal["auto", "none", "tcmalloc", "jemalloc"]
PRELOADED_ENV = "FINETUNE_PRELOADED"  # set when a local run re-executed itself with the allocator
#: tcmalloc reports every allocation over 1 GB on stderr; an SD model's weights make many
ALLOCATOR_ENV = {"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(2 ** 40)}
ALLOCATOR_LIBS = {
    "tcmalloc": ("libtcmalloc.so", "libtcmalloc.so.4", "libtcmalloc_minimal.so.4"),
    "jemalloc": ("libjemalloc.so", "libjemalloc.so.2"),
}


def find_allocators() -> dict[str, str]:
    """Name -> path of each allocator library found in the environment's or the system's lib folders."""
    dirs = [Path(sys.prefix) / "lib", *(Path(p) / "lib" for p in [os.environ.get("CONDA_PREFIX")] if p),
            Path("/usr/lib/x86_64-linux-gnu"), Path("/usr/lib/aarch64-linux-gnu"), Path("/usr/lib64"),
            Path("/usr/lib"), Path("/usr/local/lib")]
    found: dict[str, str] = {}
    for name, libs in ALLOCATOR_LIBS.items():
        hit = next((d / lib for d in dirs for lib in libs if (d / lib).is_file()), None)
        if hit is not None:
            found[name] = str(hit)
    return found


def allocator_preload(allocator: Allocator, found: dict[str, str]) -> str | None:
    """LD_PRELOAD with `allocator` (`launch.preload_allocator`) first (None: leave it as it is);
    `found`: what find_allocators() found."""
    if allocator == "auto":
        allocator = next((a for a in ("tcmalloc", "jemalloc") if a in found), "none")
    if allocator == "none":
        return None
    if allocator not in found:
        raise UserError(f"launch.preload_allocator {allocator}: {' / '.join(ALLOCATOR_LIBS[allocator])} not "
                        "found. Install it (apt-get install libtcmalloc-minimal4 | libjemalloc2, or conda "
                        "install gperftools | jemalloc) or set preload_allocator: auto or none")
    return ":".join([found[allocator], *filter(None, [os.environ.get("LD_PRELOAD")])])


def preload_locally(stage: str, allocator: Allocator) -> None:
    """A local run re-executes itself once with the allocator in LD_PRELOAD (it must be there
    when the process starts). Each training step allocates the same large blocks again (autocast's
    bf16 weight copies, gradients, activations); glibc returns every block over 32 MB to the kernel
    when freed and faults it back in, zeroed, at the next step. tcmalloc keeps them for reuse."""
    if os.environ.get(PRELOADED_ENV) or not _is_stage_program(stage):
        return  # already re-executed, or called in-process (tests, notebooks): never replace that process
    preload = allocator_preload(allocator, find_allocators())
    if preload is None:
        return
    log.info("re-executing with LD_PRELOAD=%s (launch.preload_allocator %s)", preload, allocator)
    sys.stdout.flush(), sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]],
              {**ALLOCATOR_ENV, **os.environ, "LD_PRELOAD": preload, PRELOADED_ENV: "1"})


def _is_stage_program(stage: str) -> bool:
    """True in `python -m tasks.<stage>` (what sys.orig_argv would start again)."""
    main = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    return main is not None and main.name == "__main__.py" and main.parent.name == stage and bool(sys.orig_argv)
