"""Every command fence of the README says whether tests/e2e/test_readme.py runs it."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.readme_blocks import blocks, recipe, settings, unmarked

pytestmark = pytest.mark.quick


def test_every_command_fence_is_marked_run_or_skip() -> None:
    missing = [f"README.md:{b.line} ({b.lang})" for b in unmarked()]
    assert missing == [], f"add <!-- readme-test: run --> or <!-- readme-test: skip (why) --> above {missing}"
    assert [b.lang for b in blocks() if b.runs] == ["bash", "bash", "python", "bash"]


def test_marks_are_read_from_the_line_above_the_fence(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("text\n<!-- readme-test: run -->\n```bash\nmake demo\n```\n\n```python\nx = 1\n```\n"
                      "<!-- readme-test: skip (a server) -->\n```sh\nmake serve\n```\n```\ntree\n```\n")
    found = blocks(readme)
    assert [(b.lang, b.mark, b.text) for b in found] == [
        ("bash", "run", "make demo\n"), ("python", None, "x = 1\n"), ("sh", "skip", "make serve\n"),
        ("", None, "tree\n")]
    assert [b.line for b in unmarked(readme)] == [7]


def test_recipes_are_found_by_name(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("<!-- readme-test: recipe edits -->\n```yaml\ntrain: {a: 1, b: [x]}\n```\n"
                      "<!-- readme-test: recipe edits-request -->\n```bash\ncurl x\n```\n")
    assert settings(recipe("edits", readme)) == {"train.a": 1, "train.b": ["x"]}
    assert recipe("edits-request", readme).lang == "bash" and unmarked(readme) == []
    with pytest.raises(LookupError, match="0 fences marked <!-- readme-test: recipe concepts -->"):
        recipe("concepts", readme)
    edits = settings(recipe("edits"))  # the README's own
    assert edits["ingest.sources"] == [{"type": "folder", "control_dir": "control"}], edits
    assert "/invocations" in recipe("edits-request").text
