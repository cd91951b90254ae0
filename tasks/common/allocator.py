"""The memory allocator a stage runs under (`launch.preload_allocator`).

Each training step allocates the same large blocks again (autocast's bf16 weight copies,
gradients, activations). glibc's malloc, as it comes, returns every freed block over 32 MB to the
kernel and faults it back in, zeroed, at the next step: millions of page faults a step on the SD
1.5 architecture. tcmalloc and jemalloc (in LD_PRELOAD) keep such blocks for reuse; so does glibc's
own malloc when its tunables say so (`GLIBC_TUNABLES`: never mmap, never trim), which needs
nothing installed. Both act only when a process starts: ranks get them in their launcher's
environment (tasks.common.launch), and a local run re-executes itself once with them.

This module knows allocators, not launch configs: it takes the allocator's name (`Allocator`),
and tasks.common.launch passes it on.
"""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Literal

from tasks.common.errors import UserError

log = logging.getLogger(__name__)

#: `launch.preload_allocator`: auto is tcmalloc when installed, else glibc's malloc tuned to keep
#: freed blocks; none leaves the environment as it is (glibc's defaults unless the caller set one)
Allocator = Literal["auto", "none", "tcmalloc", "jemalloc", "glibc"]
PRELOADED_ENV = "FINETUNE_PRELOADED"  # set when a local run re-executed itself with the allocator
#: tcmalloc reports every allocation over 1 GB on stderr; an SD model's weights make many
TCMALLOC_ENV = {"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(2 ** 40)}
ALLOCATOR_LIBS = {
    "tcmalloc": ("libtcmalloc.so", "libtcmalloc.so.4", "libtcmalloc_minimal.so.4"),
    "jemalloc": ("libjemalloc.so", "libjemalloc.so.2"),
}
#: glibc's malloc keeping what a step frees: no block in its own mapping (each would be unmapped
#: when freed), the heap's top never trimmed, and grown 1 GB at a time (address space; pages are
#: touched only when used). The same as MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=64G MALLOC_TOP_PAD_=1G.
GLIBC_KEEP = {"glibc.malloc.mmap_max": "0", "glibc.malloc.trim_threshold": str(2 ** 36),
              "glibc.malloc.top_pad": str(2 ** 30)}
#: what `none` (glibc's defaults) was measured to cost, said in the warning (tasks/train/README.md)
DEFAULTS_COST = ("a DreamBooth step on the SD 1.5 architecture at 256 px took 6.6 s instead of 4.6, from 820,000 "
                 "page faults a step")


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


def resolve(allocator: Allocator, found: dict[str, str]) -> str:
    """The allocator `allocator` means here: tcmalloc | jemalloc | glibc | none."""
    if allocator == "auto":
        return "tcmalloc" if "tcmalloc" in found else "glibc"
    if allocator in ALLOCATOR_LIBS and allocator not in found:
        raise UserError(f"launch.preload_allocator {allocator}: {' / '.join(ALLOCATOR_LIBS[allocator])} not "
                        "found. Install it (apt-get install libtcmalloc-minimal4 | libjemalloc2, or conda "
                        "install gperftools | jemalloc) or set preload_allocator: auto (glibc's malloc tuned "
                        "to keep freed blocks, nothing to install)")
    return allocator


def allocator_env(allocator: Allocator, found: dict[str, str]) -> dict[str, str]:
    """The variables a process must start with to run under `allocator` ({}: leave the environment
    as it is); `found`: what find_allocators() found. A caller's own LD_PRELOAD or GLIBC_TUNABLES
    is kept (its settings after ours, so they win)."""
    chosen = resolve(allocator, found)
    if chosen == "none":
        return {}
    if chosen == "glibc":
        ours = ":".join(f"{k}={v}" for k, v in GLIBC_KEEP.items())
        return {"GLIBC_TUNABLES": ":".join(filter(None, [ours, os.environ.get("GLIBC_TUNABLES")]))}
    preload = ":".join([found[chosen], *filter(None, [os.environ.get("LD_PRELOAD")])])
    return {**(TCMALLOC_ENV if chosen == "tcmalloc" else {}), "LD_PRELOAD": preload}


def preload_locally(stage: str, allocator: Allocator) -> None:
    """A local run re-executes itself once with the allocator's environment (it must be there
    when the process starts)."""
    if os.environ.get(PRELOADED_ENV) or not _is_stage_program(stage):
        return  # already re-executed, or called in-process (tests, notebooks): never replace that process
    env = allocator_env(allocator, find_allocators())
    if not env:
        return
    log.info("re-executing with %s (launch.preload_allocator %s)",
             " ".join(f"{k}={v}" for k, v in env.items() if k in ("LD_PRELOAD", "GLIBC_TUNABLES")), allocator)
    sys.stdout.flush(), sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], {**os.environ, **env, PRELOADED_ENV: "1"})


def _is_stage_program(stage: str) -> bool:
    """True in `python -m tasks.<stage>` (what sys.orig_argv would start again)."""
    main = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    return main is not None and main.name == "__main__.py" and main.parent.name == stage and bool(sys.orig_argv)


def in_use() -> str:
    """The allocator this process runs under: tcmalloc | jemalloc (mapped into it), glibc-tuned
    (glibc's malloc with mmap_max 0, from GLIBC_TUNABLES or MALLOC_MMAP_MAX_) or glibc-defaults."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        maps = ""
    for name, libs in ALLOCATOR_LIBS.items():
        if any(f"/{lib.split('.so')[0]}.so" in maps for lib in libs):
            return name
    tunables = dict(t.split("=", 1) for t in os.environ.get("GLIBC_TUNABLES", "").split(":") if "=" in t)
    if tunables.get("glibc.malloc.mmap_max", os.environ.get("MALLOC_MMAP_MAX_")) == "0":
        return "glibc-tuned"
    return "glibc-defaults"


def say_allocator(stage: str) -> str:
    """Log the allocator in use (a warning, with its cost and the fix, on glibc's defaults); returns its name."""
    name = in_use()
    if name == "glibc-defaults":
        log.warning("%s runs on glibc's default malloc, which unmaps every freed block over 32 MB and faults "
                    "it back in at the next step (%s). Fix: %s.launch.preload_allocator: auto (glibc's malloc "
                    "tuned to keep freed blocks, nothing to install; tcmalloc where installed)",
                    stage, DEFAULTS_COST, stage)
    else:
        log.info("%s runs on allocator %s", stage, name)
    return name
