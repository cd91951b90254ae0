"""Every command fence of the README and of docs/*.md says whether tests/e2e/test_readme.py runs it;
the recipes other tests run are found by name where they now live."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.readme_blocks import PAGES, README, blocks, recipe, settings, unmarked

pytestmark = pytest.mark.quick


def test_every_command_fence_is_marked_run_or_skip() -> None:
    missing = [f"README.md:{b.line} ({b.lang})" for b in unmarked()]
    assert missing == [], f"add <!-- readme-test: run --> or <!-- readme-test: skip (why) --> above {missing}"
    assert [b.lang for b in blocks() if b.runs] == ["bash", "bash", "python", "bash"]


def test_the_docs_pages_fences_are_marked_and_none_runs() -> None:
    """The README's detail moved to docs/: its fences are marked as the README's were; the walkthrough
    runs the README's only, so a docs page marks none `run`."""
    docs = [page for page in PAGES if page != README]
    assert {p.name for p in docs} >= {"recipes.md", "registry.md", "orchestration.md", "development.md"}
    missing = [f"{p.relative_to(README.parent)}:{b.line} ({b.lang})" for p in docs for b in unmarked(p)]
    assert missing == [], f"add <!-- readme-test: skip (why) --> above {missing}"
    assert [f"{p.name}:{b.line}" for p in docs for b in blocks(p) if b.runs] == []
    where = {name: [p.name for p in PAGES if any(b.name == name for b in blocks(p))]
             for name in ("edits", "video", "edits-request")}
    assert where == {"edits": ["recipes.md"], "video": ["recipes.md"], "edits-request": ["registry.md"]}, where
    prefect = [p.name for p in PAGES for b in blocks(p) if "prefect deployment run finetune/main" in b.text]
    assert prefect == ["orchestration.md"], prefect  # tests/e2e/test_prefect_deployment.py reads it there


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
