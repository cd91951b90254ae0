"""SIGTERM and SIGINT become "finish this step, save a checkpoint, exit" instead of lost work.

Schedulers (Kubernetes, Slurm, a Prefect worker shutting down) send SIGTERM and wait a grace
period; Ctrl-C sends SIGINT. The first signal sets a flag the loop checks after each optimizer
step; the handler then steps aside, so a second signal acts as usual (kills at once).
"""
from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tasks.common.errors import UserError
from tasks.common.stop_signals import asked_for, watched

log = logging.getLogger(__name__)


class TrainingInterrupted(UserError):
    """Stopped by a signal after saving a checkpoint; the process should exit with 128 + signum."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = signum


class StopFlag:
    def __init__(self) -> None:
        self.signum: int | None = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""


@contextmanager
def stop_on_signals() -> Iterator[StopFlag]:
    """Install the handlers for the body (main thread only: Python delivers signals there)."""
    flag = StopFlag()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return
    signals = watched()  # SIGTERM, SIGINT, and in a launched rank what the launcher passes them on as
    previous: dict[int, Any] = {s: signal.getsignal(s) for s in signals}

    def handler(signum: int, frame: Any) -> None:
        flag.signum = asked_for(signum)
        signal.signal(signum, previous[signum])  # a second signal acts as usual
        log.warning("%s received: finishing this step, then saving a checkpoint (send it again to stop at once)",
                    flag.name)

    for s in signals:
        signal.signal(s, handler)
    try:
        yield flag
    finally:
        for s in signals:
            signal.signal(s, previous[s])
