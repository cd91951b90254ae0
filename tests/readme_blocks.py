"""The README's fenced commands, as tests/e2e/test_readme.py runs them.

A fence the walkthrough runs is preceded by `<!-- readme-test: run -->`; one it does not run by
`<!-- readme-test: skip (why) -->`; a recipe another test runs as written (its params.yaml settings,
its request) by `<!-- readme-test: recipe NAME -->` (`recipe(NAME)` finds it). Every ```bash, ```sh
and ```python fence carries one of them. The README's detail lives in docs/*.md, marked the same way:
the walkthrough runs the README's fences only; a recipe is found in whichever page holds it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

README = Path(__file__).resolve().parents[1] / "README.md"
#: the pages whose fences are marked: the README and the docs it links to (docs/recipes.md holds the
#: recipes, docs/registry.md the edit request, docs/orchestration.md the Prefect commands)
PAGES = (README, *sorted((README.parent / "docs").glob("*.md")))
MARK = re.compile(r"^<!-- readme-test: (run|skip \((?P<why>.+)\)|recipe (?P<name>[\w-]+)) -->$")
FENCE = re.compile(r"^```(?P<lang>\w*)\s*$")
COMMAND_LANGS = ("bash", "sh", "python")


@dataclass(frozen=True)
class Block:
    line: int  # of the opening fence, 1-based
    lang: str
    mark: str | None  # "run", "skip", "recipe" or None
    text: str
    name: str | None = None  # a recipe's

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
        mark = None if above is None else ("run" if above.group(1) == "run" else "recipe" if above["name"] else "skip")
        found.append(Block(i + 1, fence["lang"], mark, "\n".join(lines[i + 1:end]) + "\n",
                           above["name"] if above else None))
        i = end + 1
    return found


def unmarked(readme: Path = README) -> list[Block]:
    """Command fences with neither mark: a new one must say whether the walkthrough runs it."""
    return [b for b in blocks(readme) if b.lang in COMMAND_LANGS and b.mark is None]


def recipe(name: str, readme: Path | None = None) -> Block:
    """The fence marked `<!-- readme-test: recipe NAME -->`: exactly one, in `readme` or else in all PAGES."""
    pages = PAGES if readme is None else (readme,)
    found = [b for page in pages for b in blocks(page) if b.mark == "recipe" and b.name == name]
    if len(found) != 1:
        where = pages[0].name if readme is not None else "README.md and docs/*.md"
        raise LookupError(f"{where}: {len(found)} fences marked <!-- readme-test: recipe {name} -->")
    return found[0]


def settings(block: Block) -> dict[str, Any]:
    """A yaml recipe's params.yaml settings as dotted keys (`ingest.data_dir`; a list is one value)."""
    import yaml

    def flat(prefix: str, value: Any) -> dict[str, Any]:
        if isinstance(value, dict):
            return {k: v for key, sub in value.items() for k, v in flat(f"{prefix}{key}.", sub).items()}
        return {prefix[:-1]: value}

    return flat("", yaml.safe_load(block.text))
