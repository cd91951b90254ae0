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

import contextlib
import ctypes
import gc
import os
import threading
from collections.abc import Iterator


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


class PhasePeaks:
    """The peak resident memory (MB) of each named phase of a run: `with peaks.phase("load"): ...`.

    A daemon thread reads the process's RSS every `interval` seconds while a phase is open; the
    kernel's own high-water mark (VmHWM) is read at each phase's start and end, so a phase that
    sets a new peak for the process gets the exact figure, and one that does not gets the sampled
    maximum (a spike shorter than the interval can be missed there). Linux only: elsewhere
    `peaks` stays empty. What runs between two phases is in none of them, so the largest phase
    can be below the process's own peak."""

    def __init__(self, interval: float = 0.05) -> None:
        self.interval = interval
        self.peaks: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if _status_mb("VmRSS") is None:
            yield
            return
        done = threading.Event()
        sampled = [_status_mb("VmRSS") or 0.0]

        def sample() -> None:
            while not done.wait(self.interval):
                sampled[0] = max(sampled[0], _statm_rss_mb())

        before = _status_mb("VmHWM") or 0.0
        thread = threading.Thread(target=sample, name=f"rss-{name}", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()
            after = _status_mb("VmHWM") or 0.0
            peak = max(sampled[0], _statm_rss_mb(), after if after > before else 0.0)
            self.peaks[name] = round(max(peak, self.peaks.get(name, 0.0)), 1)


def _status_mb(field: str) -> float | None:
    """A `kB` field of /proc/self/status in MB, or None where there is no /proc."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _statm_rss_mb() -> float:
    with open("/proc/self/statm", encoding="ascii") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1024 ** 2
