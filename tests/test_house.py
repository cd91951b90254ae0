"""The house rules ruff cannot hold: no function in tasks/ or flows/ longer than 80 lines (ruff's
PLR0912 holds the 20-branch limit). Read from the source with `ast`; nothing is imported."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.quick  # make test-fast

MAX_LINES = 80


def long_functions(root: Path, max_lines: int = MAX_LINES) -> list[str]:
    """`path:line name (N lines)` for every function or method over `max_lines`, decorators excluded."""
    found = []
    for package in ("tasks", "flows", "finetune_runtime"):
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > max_lines:
                        found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_in_tasks_or_flows_is_over_80_lines() -> None:
    found = long_functions(REPO)
    assert not found, (f"functions over {MAX_LINES} lines (split them by what they do, as tasks/train/loop.py "
                       "splits the loop into prepare, micro-step and end of step):\n" + "\n".join(found))


def test_the_length_check_finds_a_long_function(tmp_path) -> None:
    (tmp_path / "tasks").mkdir()
    (tmp_path / "flows").mkdir()
    body = "\n".join(f"        x{i} = {i}" for i in range(80))
    source = f"def short():\n    return 1\n\n\nclass A:\n    def long(self):\n{body}\n"
    (tmp_path / "tasks" / "long.py").write_text(source)
    assert long_functions(tmp_path) == ["tasks/long.py:6 long (81 lines)"]
    assert long_functions(tmp_path, max_lines=81) == []
