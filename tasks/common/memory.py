"""Giving memory back between the heavy steps of a stage.

diffusers and optimum-intel pipelines are full of reference cycles, so a pipeline that goes out
of scope keeps its weights (GBs for SD 1.5, more once compiled by OpenVINO) until Python's next
full collection, which may come only after the next pipeline is loaded. And the C allocator keeps
freed pages mapped unless asked to return them. Measured on SD 1.5 (benchmarks/export/README.md):
after the OpenVINO conversion the process held 6.0 GB; a collection brought it to 2.1 GB, and
returning the free heap to 0.7 GB.

The train stage runs under tcmalloc where it is installed (launch.preload_allocator), which keeps
what is freed for reuse and gives it back only when told: glibc's `malloc_trim` alone would leave
the training state's GBs mapped while the output is written (page cache of the files read then
counts on top of them).
"""
from __future__ import annotations

import ctypes
import gc


def release_memory() -> None:
    """Collect unreachable cycles now and return the allocator's free pages to the system."""
    gc.collect()
    return_free_heap()


def return_free_heap() -> list[str]:
    """Ask every allocator in the process to unmap its free pages; returns the ones asked.

    tcmalloc (gperftools): MallocExtension_ReleaseFreeMemory; jemalloc: purge every arena
    (MALLCTL_ARENAS_ALL is 4096); glibc: malloc_trim. Whichever is not loaded is skipped."""
    try:
        process = ctypes.CDLL(None)
    except OSError:
        return []
    asked = []
    release = getattr(process, "MallocExtension_ReleaseFreeMemory", None)
    if release is not None:
        release()
        asked.append("tcmalloc")
    mallctl = getattr(process, "mallctl", None)
    if mallctl is not None:
        mallctl(b"arena.4096.purge", None, None, None, ctypes.c_size_t(0))
        asked.append("jemalloc")
    trim = getattr(process, "malloc_trim", None)
    if trim is not None:  # glibc (musl and macOS have none)
        trim(0)
        asked.append("glibc")
    return asked
