"""User-facing errors: one clear message naming the problem and the fix, no traceback."""
from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable


class UserError(Exception):
    """A problem the user can fix (bad params, missing data, offline hub). Printed without a traceback."""


def main_guard(func: Callable[[], None]) -> Callable[[], None]:
    """Wrap a stage's CLI entry point: configure logging, print UserErrors cleanly, exit 2 on them."""

    @functools.wraps(func)
    def wrapper() -> None:
        logging.basicConfig(
            level=logging.INFO,
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
            datefmt="%H:%M:%S",
        )
        try:
            func()
        except UserError as err:
            print(f"error: {err}", file=sys.stderr)
            sys.exit(2)

    return wrapper
