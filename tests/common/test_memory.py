"""release_memory(): a dropped reference cycle gives its memory back when it is called."""
from __future__ import annotations

import gc

import numpy as np

from tasks.common.memory import release_memory


def rss_mb() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


class Pipeline:
    """Like a diffusers pipeline: weights behind an object that refers back to itself."""

    def __init__(self, megabytes: int):
        self.weights = np.ones(megabytes * 2**20, dtype=np.uint8)  # touched: resident
        self.me = self


def test_a_dropped_cycle_is_freed_by_release_memory():
    gc.collect()
    gc.disable()  # no automatic collection in between: the cycle stays until asked
    try:
        start = rss_mb()
        pipe = Pipeline(400)
        del pipe
        held = rss_mb()
        assert held - start > 350  # unreachable, yet resident
        release_memory()
        assert held - rss_mb() > 350
    finally:
        gc.enable()
