"""What a relayed run may publish: its own artifacts folder in the child's store, plain files only, capped.

The relay's parent (tasks/common/confine.py) holds the pipeline's MLflow credentials and copies a
confined child's run to the real server. The child's store is the child's to write: its run's
`artifact_uri` (or its experiment's location) may name any folder the user can read (infra/.env
included). So the parent ignores them: it reads only `<store>/artifacts/<run id>/artifacts`, the
folder MLflow gives a run of the experiment the parent created there, walked from the store's root
one folder at a time (each opened without following a link), and stages a copy of its plain files
in a folder of its own, which is what it uploads. A link, a FIFO, a socket or a device anywhere
inside, a run id that is not MLflow's 32 hex digits, or more than `max_bytes` in all refuse the
run's artifacts as a whole, with a one-line reason naming the entry; the run's record (params,
metrics, tags) is still copied.

The cap: FINETUNE_RELAY_MAX_BYTES (bytes; default 256 MiB: ingest logs its reports, its metadata
and one sample grid, a few MB even for a large data folder).
"""
from __future__ import annotations

import os
import re
import stat
from pathlib import Path

MAX_BYTES_ENV = "FINETUNE_RELAY_MAX_BYTES"
DEFAULT_MAX_BYTES = 256 * 2**20
RUN_ID = re.compile(r"[0-9a-f]{32}")
CHUNK = 2**20


class Refused(Exception):
    """The run's artifacts are not copied: the message says which entry and why, in one line."""


def max_bytes() -> int:
    """The cap on one run's artifacts, from FINETUNE_RELAY_MAX_BYTES (a UserError-worthy ValueError when bad)."""
    raw = os.environ.get(MAX_BYTES_ENV, "").strip()
    if not raw:
        return DEFAULT_MAX_BYTES
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{MAX_BYTES_ENV}={raw!r} is not a number of bytes; set a whole number "
                         f"(default {DEFAULT_MAX_BYTES}) or unset it")
    return value


def own_folder(store: Path, run_id: str) -> Path:
    """Where MLflow keeps run `run_id`'s artifacts in the relay's store (not what the run says)."""
    return store / "artifacts" / run_id / "artifacts"


def stage(store: Path, run_id: str, into: Path, limit: int) -> bool:
    """Copy run `run_id`'s own artifacts folder of `store` into the empty folder `into`, following no
    link; False when the run has no such folder (it logged no artifact); Refused otherwise."""
    if not RUN_ID.fullmatch(run_id):
        raise Refused(f"run id {run_id!r} is not MLflow's 32 hex digits; its artifacts were not copied")
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
    try:
        fd = os.open(store, flags)
    except OSError as err:
        raise Refused(f"the relay's store {store} could not be opened as a folder ({err.strerror}): run "
                      f"{run_id}'s artifacts were not copied") from None
    try:
        where = store
        for part in ("artifacts", run_id, "artifacts"):
            where = where / part
            try:
                st = os.stat(part, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                return False
            if not stat.S_ISDIR(st.st_mode):
                raise Refused(f"{where} is {_kind(st.st_mode)}, not a folder: run {run_id}'s artifacts were "
                              "not copied (the relay follows no link)")
            child = os.open(part, flags, dir_fd=fd)
            os.close(fd)
            fd = child
        _copy(fd, where, into, [0], limit, run_id)
        return True
    finally:
        os.close(fd)


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a link"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a plain file or folder"


def _copy(fd: int, shown: Path, into: Path, total: list[int], limit: int, run_id: str) -> None:
    """Copy the folder open as `fd` (shown as `shown` in messages) into `into`; total[0]: bytes so far."""
    for name in sorted(os.listdir(fd)):
        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            try:
                (into / name).mkdir()
                _copy(sub, shown / name, into / name, total, limit, run_id)
            finally:
                os.close(sub)
            continue
        if not stat.S_ISREG(st.st_mode):
            raise Refused(f"{shown / name} is {_kind(st.st_mode)}: run {run_id}'s artifacts were not copied "
                          "(the relay copies plain files only and follows no link)")
        try:  # no link followed, no FIFO waited on, even if one replaced the file since the stat
            src = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
        except OSError as err:
            raise Refused(f"{shown / name} could not be opened as a plain file ({err.strerror}): run {run_id}'s "
                          "artifacts were not copied") from None
        try:
            if not stat.S_ISREG(os.fstat(src).st_mode):
                raise Refused(f"{shown / name} is not a plain file: run {run_id}'s artifacts were not copied")
            with open(into / name, "xb") as out:
                while chunk := os.read(src, CHUNK):
                    total[0] += len(chunk)
                    if total[0] > limit:
                        raise Refused(f"{shown} holds more than {limit} bytes ({MAX_BYTES_ENV}): run {run_id}'s "
                                      f"artifacts were not copied (at {shown / name}); raise {MAX_BYTES_ENV} if "
                                      "the stage's artifacts are that large")
                    out.write(chunk)
        finally:
            os.close(src)
