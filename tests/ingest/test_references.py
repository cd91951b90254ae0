"""Reference (condition) images for edit training: found by each convention, checked, kept with their target."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from tasks.common.errors import UserError
from tests.ingest.test_sources import png_bytes
from tests.ingest.util import config, picture, run, save

pytestmark = pytest.mark.quick


def _solid(colour: tuple[int, int, int], size: tuple[int, int] = (96, 96)) -> Image.Image:
    return Image.new("RGB", size, colour)


def test_control_dir_pairs_references_with_their_targets(tmp_path: Path) -> None:
    root = tmp_path / "edits"
    save(root / "a.png", picture(1, (128, 96)), caption="make it red")
    save(root / "control" / "a.jpg", _solid((200, 0, 0), (80, 80)), quality=100)  # other size, extension
    save(root / "b.png", picture(2), caption="merge them")
    save(root / "control" / "b_1.png", _solid((0, 0, 200)))  # musubi's numbering, in number order
    save(root / "control" / "b_0.png", _solid((0, 200, 0)))
    save(root / "sub" / "c.png", picture(3))
    save(root / "control" / "sub" / "c.png", _solid((9, 9, 9)))
    save(root / "g.png", picture(4))
    save(root / "g_1.png", picture(5))  # a target of its own: control/g_1.png is its reference, not g's
    save(root / "control" / "g.png", _solid((1, 2, 3)))
    save(root / "control" / "g_1.png", _solid((4, 5, 6)))
    save(root / "d.png", picture(6))  # no reference
    save(root / "e.png", picture(7))
    (root / "control" / "e.png").write_bytes(b"not an image")
    save(root / "f.png", picture(8))
    save(root / "control" / "f.png", _solid((0, 0, 0), (8, 8)))  # under min_side
    src = {"type": "folder", "path": str(root), "control_dir": "control"}
    r = run(config([src], output_size="square", resolution=64, near_duplicate_distance=None), tmp_path / "out")

    assert r.reasons() == {"d.png": "missing_reference", "e.png": "bad_reference", "f.png": "bad_reference"}
    details = {row["path"]: row["detail"] for row in r.rejected}
    assert "reference e.png: not_an_image" in details["e.png"] and "too_small" in details["f.png"]
    rows = r.by_path()
    assert set(rows) == {"a.png", "b.png", "sub/c.png", "g.png", "g_1.png"}  # nothing under control/ is a target
    assert rows["a.png"]["text"] == "make it red"
    stem = {p: Path(row["file_name"]).stem for p, row in rows.items()}
    assert rows["a.png"]["reference_file_names"] == [f"references/{stem['a.png']}.png"]
    assert rows["b.png"]["reference_file_names"] == [f"references/{stem['b.png']}_{i}.png" for i in (0, 1)]
    colours = {p: [Image.open(r.out / n).getpixel((32, 32)) for n in row["reference_file_names"]]
               for p, row in rows.items()}
    assert colours["b.png"] == [(0, 200, 0), (0, 0, 200)]
    assert colours["g.png"] == [(1, 2, 3)] and colours["g_1.png"] == [(4, 5, 6)]
    assert colours["sub/c.png"] == [(9, 9, 9)]
    assert np.abs(np.subtract(colours["a.png"][0], (200, 0, 0))).max() <= 3  # JPEG
    for row in rows.values():  # every reference has its processed target's size
        for name in row["reference_file_names"]:
            assert Image.open(r.out / name).size == (row["width"], row["height"]) == (64, 64)
    assert r.summary.report()["references"] == {"targets": 5, "files": 6}


def test_references_without_control_dir_and_a_missing_control_dir(tmp_path: Path) -> None:
    root = tmp_path / "plain"
    save(root / "a.png", picture(1))
    plain = run(config(root), tmp_path / "out")
    assert plain.kept[0]["reference_file_names"] == [] and not (plain.out / "references").exists()
    with pytest.raises(UserError, match=r"sources\.0\.control_dir: .* is not a folder"):
        run(config([{"type": "folder", "path": str(root), "control_dir": "nope"}]), tmp_path / "out2")


def test_a_changed_reference_is_not_served_from_the_cache(tmp_path: Path) -> None:
    root = tmp_path / "edits"
    save(root / "a.png", picture(1))
    save(root / "control" / "a.png", _solid((10, 10, 10)))
    cfg = config([{"type": "folder", "path": str(root), "control_dir": "control"}],
                 cache_dir=str(tmp_path / "cache"))
    first = run(cfg, tmp_path / "out1")
    assert Image.open(first.out / first.kept[0]["reference_file_names"][0]).getpixel((0, 0)) == (10, 10, 10)
    save(root / "control" / "a.png", _solid((99, 99, 99)))
    second = run(cfg, tmp_path / "out2")
    assert Image.open(second.out / second.kept[0]["reference_file_names"][0]).getpixel((0, 0)) == (99, 99, 99)
    assert second.summary.cache_hits == 0
    assert run(cfg, tmp_path / "out3").summary.cache_hits == 1


def test_imagefolder_cond_image_column(tmp_path: Path) -> None:
    root = tmp_path / "hf"
    for i, name in enumerate(("t1.png", "t2.png", "t3.png", "t4.png")):
        save(root / "target" / name, picture(i + 1))
    save(root / "input" / "i1.png", _solid((50, 0, 0)))
    save(root / "input" / "i2a.png", _solid((0, 50, 0)))
    save(root / "input" / "i2b.png", _solid((0, 0, 50)))
    save(tmp_path / "secret.png", _solid((1, 1, 1)))
    rows = [{"file_name": "target/t1.png", "text": "redden", "input": "input/i1.png"},
            {"file_name": "target/t2.png", "text": "two", "input": ["input/i2a.png", "input/i2b.png"]},
            {"file_name": "target/t3.png", "text": "none", "input": None},
            {"file_name": "target/t4.png", "text": "escape", "input": "../secret.png"}]
    (root / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    src = {"type": "imagefolder", "path": str(root), "cond_image_column": "input"}
    r = run(config([src], near_duplicate_distance=None), tmp_path / "out")
    assert r.reasons() == {"target/t3.png": "missing_reference", "target/t4.png": "outside_root"}
    kept = r.by_path()
    assert set(kept) == {"target/t1.png", "target/t2.png"}  # the inputs are no targets of their own
    colours = {p: [Image.open(r.out / n).getpixel((0, 0)) for n in row["reference_file_names"]]
               for p, row in kept.items()}
    assert colours == {"target/t1.png": [(50, 0, 0)], "target/t2.png": [(0, 50, 0), (0, 0, 50)]}


def test_hub_cond_image_column(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    parquet = tmp_path / "edits" / "data"
    parquet.mkdir(parents=True)
    struct = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    targets = [{"bytes": png_bytes(i), "path": None} for i in range(3)]
    inputs = [{"bytes": png_bytes(10), "path": None}, None, {"bytes": b"junk", "path": None}]
    table = pa.table({"image": pa.array(targets, type=struct), "input": pa.array(inputs, type=struct),
                      "text": ["a", "b", "c"]})
    pq.write_table(table, parquet / "train-00000-of-00001.parquet")
    source = {"type": "hub", "name": str(tmp_path / "edits"), "revision": "main", "cond_image_column": "input"}
    r = run(config([source], near_duplicate_distance=None), tmp_path / "out")
    assert r.reasons() == {"train/1": "missing_reference", "train/2": "bad_reference"}
    (row,) = r.kept
    assert len(row["reference_file_names"]) == 1 and (r.out / row["reference_file_names"][0]).is_file()
