"""User-facing errors: one clear message naming the problem and the fix, no traceback."""
from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path


class UserError(Exception):
    """A problem the user can fix (bad params, missing data, offline hub). Printed without a traceback."""


def main_guard(func: Callable[[], None]) -> Callable[[], None]:
    """Wrap a stage's CLI entry point: configure logging (the project's lines on the terminal, other
    libraries' in the stage's log file: tasks.common.quiet), print UserErrors cleanly, exit 2 on them."""

    @functools.wraps(func)
    def wrapper() -> None:
        try:
            level = log_level()
            logging.basicConfig(
                level=level,
                format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                datefmt="%H:%M:%S",
            )
            if func.__module__ == "__main__":  # a stage's process, not a test calling main()
                from tasks.common.quiet import quiet, stage_name

                quiet(stage_name(), verbose=level <= logging.DEBUG)
            func()
        except UserError as err:
            print(f"error: {err}", file=sys.stderr)
            if note := removed_outputs_note():
                print(note, file=sys.stderr)
            sys.exit(2)

    return wrapper


def removed_outputs_note(environ: Mapping[str, str] | None = None, workdir: Path | None = None) -> str:
    """Under `dvc repro`, which removes a stage's outputs (all but `persist: true` ones) before it
    runs the stage's command: the outputs dvc.lock records for this stage that are gone, and the
    command that brings those last good ones back from DVC's cache. '' outside DVC (no DVC_STAGE
    in the environment) or when nothing is missing."""
    environ = os.environ if environ is None else environ
    stage = environ.get("DVC_STAGE", "").rpartition(":")[2]  # "train", or "sub/dvc.yaml:train"
    lock = Path.cwd() / "dvc.lock" if workdir is None else Path(workdir) / "dvc.lock"
    if not stage or not lock.is_file():
        return ""
    import yaml

    try:
        entry = (yaml.safe_load(lock.read_text()) or {}).get("stages", {}).get(stage) or {}
        paths = [str(out["path"]) for out in entry.get("outs") or []]
    except (yaml.YAMLError, AttributeError, KeyError, TypeError):
        return ""  # a lock this note cannot read: the error above stands alone
    gone = [p for p in paths if not (lock.parent / p).exists()]
    if not gone:
        return ""
    return (f"note: DVC removed this stage's last outputs before running it ({', '.join(gone)}); "
            f"`dvc checkout {stage}` brings them back from DVC's cache as dvc.lock records them")


LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def log_level() -> int:
    """The terminal's level from LOG_LEVEL (default INFO); DEBUG also shows other libraries' lines."""
    name = os.environ.get("LOG_LEVEL", "INFO").strip().upper() or "INFO"
    if name not in LEVELS:
        raise UserError(f"LOG_LEVEL={os.environ['LOG_LEVEL']!r} is not a level: use one of "
                        f"{', '.join(LEVELS)} (DEBUG shows other libraries' log lines too)")
    return getattr(logging, name)
