"""`make help` names every make target the README uses, and `make figures` rewrites only the rows
it measured in the README's table (benchmarks/figures.py)."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from benchmarks import figures
from tests.conftest import REPO

pytestmark = pytest.mark.quick


def test_make_help_lists_every_target_the_readme_uses() -> None:
    readme = (REPO / "README.md").read_text()
    # in inline code (`make demo`, `make clean MLFLOW=1`) and at the start of a code block's line
    used = {*re.findall(r"`[^`\n]*\bmake ([a-z][a-z-]+)", readme), *re.findall(r"^make ([a-z][a-z-]+)", readme, re.M)}
    helped = subprocess.run(["make", "-s", "help"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    listed = set(re.findall(r"^make ([a-z-]+)", helped, re.M))
    assert {"demo", "test", "install", "data", "figures"} <= used, sorted(used)
    assert used <= listed, f"the README uses make targets that make help does not list: {sorted(used - listed)}"


def test_figures_rewrite_only_what_was_measured(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    text = (REPO / "README.md").read_text()
    readme.write_text(text)
    figures.rewrite({"demo": "123 s"}, "2026-01-01, a CPU, 2 cores", readme)
    new = readme.read_text()
    rows = new.split(figures.START)[1].split(figures.END)[0].strip().splitlines()
    assert len(rows) == 2 + len(figures.ROWS)
    assert f"| {figures.ROWS['demo']} | 123 s | 2026-01-01, a CPU, 2 cores |" in rows
    kept = [r for r in rows[2:] if not r.startswith(f"| {figures.ROWS['demo']} |")]
    assert all(r in text for r in kept), "rows not measured keep their figures"
    assert new.split(figures.START)[0] == text.split(figures.START)[0]
    assert new.split(figures.END)[1] == text.split(figures.END)[1]


def test_the_pytest_summary_is_read_from_its_line() -> None:
    out = "x\n========== 863 passed, 1 skipped, 229 warnings in 2500.85s (0:41:40) ===========\nci took 2828 s\n"
    assert figures.pytest_summary(out) == "pytest: 863 passed, 1 skipped, 229 warnings in 2500.85s"
