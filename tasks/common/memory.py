"""Giving memory back between the heavy steps of a stage.

diffusers and optimum-intel pipelines are full of reference cycles, so a pipeline that goes out
of scope keeps its weights (GBs for SD 1.5, more once compiled by OpenVINO) until Python's next
full collection, which may come only after the next pipeline is loaded. And glibc keeps freed heap
pages mapped unless asked to return them. Measured on SD 1.5 (benchmarks/export/README.md): after
the OpenVINO conversion the process held 6.0 GB; a collection brought it to 2.1 GB, and returning
the free heap to 0.7 GB.
"""
from __future__ import annotations

import ctypes
import gc


def release_memory() -> None:
    """Collect unreachable cycles now and return the C heap's free pages to the system."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (musl, macOS): collection only
        pass
