"""Text stored in a version's tags and description: one line, without log prefixes.

A failed command's output (a stage's log lines, `error: ...` last) pasted into a tag reads as a
wall of timestamps in the registry; what a reader needs is what failed and the fix, which the
stages print last as `error: <what> ... <fix>`.
"""
from __future__ import annotations

import re

#: The project's log prefix (`10:03:16 INFO tasks.evaluate: `, tasks/common/errors.py) and Prefect's
#: (`10:03:16.123 | ERROR   | prefect.task_runs - `), with or without a date first.
_PREFIX = re.compile(
    r"^\s*(\d{4}-\d\d-\d\d[ T])?\d\d:\d\d:\d\d([.,]\d+)?\s+"
    r"(\|\s*[A-Z]+\s*\|\s*[\w.\-]+\s+-\s+|[A-Z]+\s+[\w.\-]+:\s+)")


def strip_prefix(line: str) -> str:
    """`line` without a leading log prefix."""
    return _PREFIX.sub("", line, count=1).strip()


def one_line(text: str, limit: int = 1000) -> str:
    """`text` in one line: its lines without log prefixes, joined by spaces, at most `limit`
    characters (cut with an ellipsis)."""
    joined = " ".join(part for part in (strip_prefix(line) for line in str(text).splitlines()) if part)
    return joined if len(joined) <= limit else joined[: limit - 1].rstrip() + "…"


def last_error(output: str) -> str:
    """What a failed stage said last: its `error: ...` line (without `error: `), else its last
    non-empty line; log prefixes removed."""
    lines = [strip_prefix(line) for line in output.splitlines() if line.strip()]
    errors = [line.removeprefix("error:").strip() for line in lines if line.startswith("error:")]
    if errors:
        return errors[-1]
    return lines[-1] if lines else "no output"


#: How long a failure's reason may be in a tag or a description: what failed and the fix, not a log.
REASON_CHARS = 300


def reason(err: BaseException, limit: int = REASON_CHARS) -> str:
    """Why `err` happened, in one short line: a UserError's own message (it names what and the fix);
    any other exception's type first (`OSError: ...`), as it would otherwise only show in a traceback."""
    from tasks.common.errors import UserError

    text = one_line(str(err), limit=limit)
    if isinstance(err, UserError):
        return text or type(err).__name__
    return one_line(f"{type(err).__name__}: {text}" if text else type(err).__name__, limit=limit)
