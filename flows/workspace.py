"""One pipeline run at a time per workspace.

DVC locks the repository while one `dvc repro` runs, so two `dvc repro` at once already refuse
each other ("Unable to acquire lock"). The flow, though, runs one `dvc repro --single-item` per
stage: between two stages DVC's lock is free, and a second flow could slip in, change what the
stages read and rerun stages under the first one's feet. So the
flow holds a lock of its own for its whole run, next to DVC's (in .dvc/tmp), taken before
anything is written. It is an OS file lock (flock): a run that is killed releases it with its
process, so a crash never leaves a stale lock behind.
"""
from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tasks.common.errors import UserError

LOCK_NAME = "finetune-flow.lock"


class WorkspaceBusy(UserError):
    """Another pipeline run holds this workspace."""


def lock_path(root: Path) -> Path:
    return Path(root) / ".dvc" / "tmp" / LOCK_NAME


@contextmanager
def workspace_lock(root: Path, owner: str = "") -> Iterator[Path]:
    """Hold the workspace for one pipeline run; refuse at once (no waiting) if it is held."""
    path = lock_path(root)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(path)
            raise WorkspaceBusy(
                f"another pipeline run is already running in {root} ({holder}); two runs in one "
                "workspace would overwrite each other's params.yaml and outputs. Wait for it to "
                "finish (or stop it), or run in a separate clone of the repository"
            ) from None
        info = {"pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "owner": owner}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        try:
            yield path
        finally:
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _read_holder(path: Path) -> str:
    try:
        info = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        info = {}
    if not info:
        return "holder unknown"
    owner = f", {info['owner']}" if info.get("owner") else ""
    return f"pid {info.get('pid')}, started {info.get('since')}{owner}"
