"""The generated corpus of bad and awkward inputs: no crash, the expected reason for each input."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from PIL import Image

from tasks.ingest.checks import REASONS
from tests.ingest.corpus import PARAMS, build
from tests.ingest.util import config, read_jsonl, run

pytestmark = pytest.mark.quick  # make test-fast


@pytest.mark.timeout(120)  # the corpus holds a FIFO: opening it to read would hang the run
def test_every_input_is_kept_or_rejected_with_the_expected_reason(tmp_path: Path) -> None:
    sources, expected = build(tmp_path / "corpus")
    r = run(config(sources, workers=2, cache_dir=str(tmp_path / "cache"), **PARAMS), tmp_path / "out")
    got = {(row["source"], row["path"]): row["reason"] for row in r.rejected}
    for row in r.kept:
        got[(row["source"], row.get("metadata_file") or row["path"])] = "kept"
    clips = read_jsonl(r.out / "clips.jsonl")
    for row in clips:
        got[(row["source"], row["path"])] = "kept"
    assert got == expected
    assert set(REASONS) <= set(expected.values()), "the corpus exercises every reason"

    report = r.summary.report()
    assert report["total"] == len(expected) == report["kept"] + report["rejected"]
    assert report["clips"] == {"inputs": 9, "kept": 2, "by_bucket": {"64x64x9": 2}}
    assert sorted(p.name for p in (r.out / "clips").iterdir()) == sorted(row["file_name"][6:] for row in clips)
    assert report["rejected_by_reason"] == {
        reason: Counter(expected.values())[reason] for reason in REASONS}
    assert sum(s["total"] for s in report["by_source"].values()) == report["total"]
    # every rejected row says why, and every kept row's image is there, upright RGB
    assert all(row["detail"] for row in r.rejected)
    files = {p.name for p in r.out.iterdir()} - {"metadata.jsonl", "masks", "references", "clips", "clips.jsonl"}
    assert files == {row["file_name"] for row in r.kept}
    masks = {f"masks/{p.name}" for p in (r.out / "masks").iterdir()}
    assert masks == {row["mask_file_name"] for row in r.kept if row["mask_file_name"]} and len(masks) == 1
    for row in r.kept:
        with Image.open(r.out / row["file_name"]) as im:
            assert im.mode == "RGB" and im.size == (row["width"], row["height"]) == (64, 64)
    rotated = next(row for row in r.kept if row["path"] == "rotated.jpg")
    assert (rotated["source_width"], rotated["source_height"]) == (90, 120)
    unicode = next(row for row in r.kept if row["path"].startswith("ünïcödé"))
    assert unicode["file_name"].isascii() and unicode["text"] == "a photo"
