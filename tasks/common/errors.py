"""User-facing errors: one clear message naming the problem and the fix, no traceback."""
from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable


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
            sys.exit(2)

    return wrapper


LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def log_level() -> int:
    """The terminal's level from LOG_LEVEL (default INFO); DEBUG also shows other libraries' lines."""
    name = os.environ.get("LOG_LEVEL", "INFO").strip().upper() or "INFO"
    if name not in LEVELS:
        raise UserError(f"LOG_LEVEL={os.environ['LOG_LEVEL']!r} is not a level: use one of "
                        f"{', '.join(LEVELS)} (DEBUG shows other libraries' log lines too)")
    return getattr(logging, name)
