"""The training notes' metadata rules (seed 003), rule by rule, then the metadata_json source."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tasks.ingest.checks import Reject
from tasks.ingest.config import MetadataJsonSource
from tasks.ingest.metadata import apply_rules, parse
from tests.ingest.util import config, picture, run, save

pytestmark = pytest.mark.quick  # make test-fast


def rules(**kw) -> MetadataJsonSource:
    return MetadataJsonSource(type="metadata_json", path=Path("."), **kw)


def rejected_by(tags: list[str], score: float | None, **kw) -> str:
    with pytest.raises(Reject) as err:
        apply_rules(tags, score, rules(**kw))
    return err.value.reason


def test_no_rules_keeps_tags_as_they_are() -> None:
    assert apply_rules(["solo", "oc only"], 55, rules()) == ["solo", "oc only"]
    assert apply_rules(["a"], None, rules()) == ["a"]  # no score needed without score rules


def test_abs_min_score_uses_the_raw_score() -> None:
    assert rejected_by(["solo"], 49, abs_min_score=50) == "abs_min_score"
    assert apply_rules(["solo"], 50, rules(abs_min_score=50)) == ["solo"]
    # a bonus does not rescue an image under abs_min_score
    assert rejected_by(["solo"], 40, abs_min_score=50, tag_bonus_scores={"solo": 100}) == "abs_min_score"


def test_score_tags_add_the_highest_threshold_reached() -> None:
    thresholds = [3200, 1600, 800, 50, 25, 5]
    assert apply_rules(["x"], 1700, rules(score_tags=thresholds)) == ["x", "scr1600"]
    assert apply_rules(["x"], 50, rules(score_tags=[5, 50, 25])) == ["x", "scr50"]  # any order
    assert apply_rules(["x"], 4, rules(score_tags=thresholds)) == ["x"]


def test_min_score_applies_after_tag_bonus_scores() -> None:
    bonus = {"solo": 100, "monochrome": -75}
    assert apply_rules(["solo"], 150, rules(min_score=200, tag_bonus_scores=bonus)) == ["solo"]
    assert rejected_by(["duo"], 150, min_score=200, tag_bonus_scores=bonus) == "min_score"
    assert rejected_by(["solo", "monochrome"], 150, min_score=200, tag_bonus_scores=bonus) == "min_score"
    # a score tag can carry a bonus too (the notes add score tags before bonuses)
    assert apply_rules(["x"], 160, rules(min_score=200, score_tags=[150],
                                         tag_bonus_scores={"scr150": 50})) == ["x", "scr150"]


def test_blacklist_tags_drop_the_image() -> None:
    assert rejected_by(["solo", "animated"], 100, blacklist_tags=["animated"]) == "blacklist_tags"
    assert apply_rules(["solo"], 100, rules(blacklist_tags=["animated"])) == ["solo"]


def test_non_caption_tags_drop_the_tag_only() -> None:
    kept = apply_rules(["solo", "high res", "safe"], 1, rules(non_caption_tags=["high res"]))
    assert kept == ["solo", "safe"]


def test_replacements_rewrite_substrings_in_order() -> None:
    repl = {"princess luna": "luna", "artist:": "by=", ":": "=", " ": "_"}
    kept = apply_rules(["princess luna", "artist:lulubell", "oc:kindle", "oc only"], 1,
                       rules(replacements=repl))
    assert kept == ["luna", "by=lulubell", "oc=kindle", "oc_only"]


def test_missing_score_with_score_rules_is_bad_metadata() -> None:
    assert rejected_by(["a"], None, min_score=1) == "bad_metadata"


@pytest.mark.parametrize(
    ("text", "detail"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "not a JSON object"),
        ('{"tags": "solo", "path": "a.png"}', "`tags`"),
        ('{"tags": ["solo"]}', "`path`"),
        ('{"tags": [], "path": "a.png", "score": "high"}', "`score`"),
    ],
)
def test_parse_rejects_malformed_metadata(text: str, detail: str) -> None:
    with pytest.raises(Reject, match=detail) as err:
        parse(text.encode())
    assert err.value.reason == "bad_metadata"


def test_parse_ignores_extra_keys() -> None:
    data = {"tags": ["oc"], "score": 55, "path": "images/1.png", "id": 7, "source": "booru"}
    assert parse(json.dumps(data).encode()) == (["oc"], 55, "images/1.png")


def write_meta(root: Path, rel: str, **meta) -> None:
    path = root / "metadata" / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(meta))


def test_metadata_json_source_stores_tags_as_data(tmp_path: Path) -> None:
    root = tmp_path / "booru"
    for i in range(6):
        save(root / "images" / f"{i}.png", picture(i))
    write_meta(root, "a/0.json", tags=["oc", "solo", "high res"], score=300, path="images/0.png")
    write_meta(root, "a/1.json", tags=["oc"], score=10, path="images/1.png")  # abs_min_score
    write_meta(root, "b/2.json", tags=["duo"], score=150, path="images/2.png")  # min_score
    write_meta(root, "b/3.json", tags=["solo", "animated"], score=900, path="images/3.png")
    write_meta(root, "c/4.json", tags=["solo"], score=120, path="images/4.png")  # bonus saves it
    write_meta(root, "c/5.json", tags=["oc"], score=500, path="../outside.png")
    write_meta(root, "c/6.json", tags=["oc"], score=500, path="images/missing.png")
    (root / "metadata" / "notes.txt").write_text("not metadata")
    source = {
        "type": "metadata_json", "path": str(root), "abs_min_score": 50, "min_score": 200,
        "tag_bonus_scores": {"solo": 100}, "score_tags": [800, 200, 100],
        "blacklist_tags": ["animated"], "non_caption_tags": ["high res"],
        "replacements": {" ": "_"}, "tag_separator": " ",
    }
    r = run(config([source]), tmp_path / "out")
    assert r.reasons() == {
        "metadata/a/1.json": "abs_min_score",
        "metadata/b/2.json": "min_score",
        "metadata/b/3.json": "blacklist_tags",
        "metadata/c/5.json": "outside_root",
        "metadata/c/6.json": "missing_image",
        "metadata/notes.txt": "unsupported_extension",
    }
    rows = r.by_path()
    assert set(rows) == {"images/0.png", "images/4.png"}
    first = rows["images/0.png"]
    assert first["tags"] == ["oc", "solo", "scr200"] and first["text"] == "oc solo scr200"
    assert first["tag_separator"] == " " and first["score"] == 300
    assert first["metadata_file"] == "metadata/a/0.json" and first["caption_source"] == "tags"
    assert rows["images/4.png"]["tags"] == ["solo", "scr100"]
    assert r.summary.total == 8 and r.summary.kept + r.summary.rejected == 8


def test_consider_every_nth_counts_json_files_in_sorted_order(tmp_path: Path) -> None:
    root = tmp_path / "set"
    for i in range(7):
        save(root / "img" / f"{i}.png", picture(i))
        write_meta(root, f"m/{i}.json", tags=[f"t{i}"], score=1, path=f"img/{i}.png")
    r = run(config([{"type": "metadata_json", "path": str(root), "consider_every_nth": 3}]),
            tmp_path / "out")
    assert sorted(r.by_path()) == ["img/0.png", "img/3.png", "img/6.png"]
    assert set(r.reasons().values()) == {"consider_every_nth"} and len(r.rejected) == 4


def test_missing_metadata_dir_is_a_user_error(tmp_path: Path) -> None:
    from tasks.common.errors import UserError

    (tmp_path / "ds").mkdir()
    with pytest.raises(UserError, match=r"sources\.0\.metadata_dir: .* is not a folder"):
        run(config([{"type": "metadata_json", "path": str(tmp_path / "ds")}]), tmp_path / "out")
