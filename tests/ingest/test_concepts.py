"""Concepts at ingest: kohya's `<repeats>_<name>` folders and sources naming their concept."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tasks.common.errors import UserError
from tasks.ingest.kohya import parse
from tests.ingest.util import config, picture, run, save

pytestmark = pytest.mark.quick


def test_kohya_folders_give_concept_repeats_and_the_class_tokens_as_fallback_caption(tmp_path: Path) -> None:
    root = tmp_path / "train"
    save(root / "10_sks dog" / "a.png", picture(1), caption="sks dog on grass")
    save(root / "10_sks dog" / "b.png", picture(2))  # no caption file: "sks dog"
    save(root / "3_ohwx cat" / "nested" / "c.png", picture(3))
    r = run(config([{"type": "folder", "path": str(root), "kohya_folders": True}]), tmp_path / "out")
    rows = {row["path"]: row for row in r.kept}
    got = {p: (row["concept"], row["repeats"], row["text"], row["caption_source"]) for p, row in rows.items()}
    assert got == {
        "10_sks dog/a.png": ("sks dog", 10, "sks dog on grass", "file"),
        "10_sks dog/b.png": ("sks dog", 10, "sks dog", "folder_name"),
        "3_ohwx cat/nested/c.png": ("ohwx cat", 3, "ohwx cat", "folder_name"),
    }
    assert r.summary.report()["by_concept"] == {"ohwx cat": 1, "sks dog": 2}


def test_without_the_option_kohya_like_folders_stay_ordinary_with_a_hint(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "train"
    save(root / "2_cats" / "a.png", picture(1))
    with caplog.at_level(logging.WARNING):
        r = run(config(root), tmp_path / "out")
    assert [(row["concept"], row["repeats"], row["caption_source"]) for row in r.kept] == [(None, 1, "fallback")]
    assert "kohya_folders: true" in caplog.text
    assert "by_concept" not in r.summary.report()


def test_explicit_concepts_per_source(tmp_path: Path) -> None:
    save(tmp_path / "dog" / "a.png", picture(1), caption="a dog")
    save(tmp_path / "cat" / "b.png", picture(2))
    sources = [{"type": "folder", "path": str(tmp_path / "dog"), "concept": "dog", "repeats": 4},
               {"type": "imagefolder", "path": str(tmp_path / "cat"), "concept": "cat"}]
    r = run(config(sources), tmp_path / "out")
    assert sorted((row["concept"], row["repeats"]) for row in r.kept) == [("cat", 1), ("dog", 4)]


def test_bad_kohya_layouts_are_refused_with_the_fix(tmp_path: Path) -> None:
    root = tmp_path / "train"
    save(root / "10_dog" / "a.png", picture(1))
    save(root / "misc" / "b.png", picture(2))
    with pytest.raises(UserError, match=r"'misc' .*<repeats>_<name>.*kohya_folders: false"):
        run(config([{"type": "folder", "path": str(root), "kohya_folders": True}]), tmp_path / "out")
    (root / "misc" / "b.png").rename(root / "b.png")
    (root / "misc").rmdir()
    with pytest.raises(UserError, match="holds files itself"):
        run(config([{"type": "folder", "path": str(root), "kohya_folders": True}]), tmp_path / "out2")
    with pytest.raises(ValueError, match=r"sources\.0\n.*remove concept"):
        config([{"type": "folder", "path": str(root), "kohya_folders": True, "concept": "x"}])
    with pytest.raises(ValueError, match=r"sources\.0\.concept\n.*folder name"):
        config([{"type": "folder", "path": str(root), "concept": "../x"}])


def test_parse_folder_names() -> None:
    assert (parse("10_sks dog").name, parse("10_sks dog").repeats) == ("sks dog", 10)
    assert parse("1_a_b").name == "a_b"
    assert parse("cats") is None and parse("10_") is None and parse("x_10") is None
