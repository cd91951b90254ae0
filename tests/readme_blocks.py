"""The README's fenced commands, as tests/e2e/test_readme.py runs them.

A fence the walkthrough runs is preceded by `<!-- readme-test: run -->`; one it does not run by
`<!-- readme-test: skip (why) -->`. Every ```bash, ```sh and ```python fence carries one of them.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
MARK = re.compile(r"^<!-- readme-test: (run|skip \((?P<why>.+)\)) -->$")
FENCE = re.compile(r"^```(?P<lang>\w*)\s*$")
COMMAND_LANGS = ("bash", "sh", "python")


@dataclass(frozen=True)
class Block:
    line: int  # of the opening fence, 1-based
    lang: str
    mark: str | None  # "run", "skip" or None
    text: str

    @property
    def runs(self) -> bool:
        return self.mark == "run"


def blocks(readme: Path = README) -> list[Block]:
    """Every fenced block of the README, in reading order, with the mark on the line above it."""
    lines = readme.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        above = MARK.match(lines[i - 1]) if i else None
        mark = None if above is None else ("run" if above.group(1) == "run" else "skip")
        found.append(Block(i + 1, fence["lang"], mark, "\n".join(lines[i + 1:end]) + "\n"))
        i = end + 1
    return found


def unmarked(readme: Path = README) -> list[Block]:
    """Command fences with neither mark: a new one must say whether the walkthrough runs it."""
    return [b for b in blocks(readme) if b.lang in COMMAND_LANGS and b.mark is None]
