"""Subject masks at ingest: each convention read, bad masks rejected by name, geometry kept."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.ingest.util import config, picture, run, save

pytestmark = pytest.mark.quick  # make test-fast


def _mask(size: tuple[int, int], box: tuple[int, int, int, int]) -> Image.Image:
    """White inside `box` (left, top, right, bottom), black elsewhere."""
    mask = Image.new("L", size, 0)
    mask.paste(255, box)
    return mask


def test_masks_by_each_convention_and_bad_masks_rejected(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    save(root / "a.png", picture(1, (128, 96)))  # mask in mask_dir, other extension
    save(root / "masks" / "a.jpg", _mask((128, 96), (40, 0, 88, 96)), quality=100)
    save(root / "sub" / "b.png", picture(2))  # mask in the mask folder's sub-folder
    save(root / "masks" / "sub" / "b.png", _mask((96, 96), (0, 0, 48, 96)))
    save(root / "c.png", picture(3))  # OneTrainer's masklabel beside it
    save(root / "c-masklabel.png", _mask((96, 96), (0, 0, 96, 30)))
    rgba = picture(4).convert("RGBA")
    rgba.putalpha(_mask((96, 96), (10, 10, 60, 60)))
    save(root / "d.png", rgba)  # alpha channel
    save(root / "e.png", picture(5))  # no mask at all
    save(root / "f.png", picture(6))
    save(root / "masks" / "f.png", _mask((64, 64), (0, 0, 10, 10)))  # wrong size
    save(root / "g.png", picture(7))
    save(root / "masks" / "g.png", Image.new("L", (96, 96), 0))  # all black
    save(root / "h.png", picture(8))
    (root / "masks" / "h.png").write_bytes(b"not a png")  # unreadable
    save(root / "zz-masklabel.png", _mask((96, 96), (0, 0, 5, 5)))  # no image zz
    src = {"type": "folder", "path": str(root), "mask_dir": "masks"}
    result = run(config([src], alpha_mask=True, output_size="square", resolution=64, near_duplicate_distance=None),
                 tmp_path / "out")
    reasons = result.reasons()
    assert reasons == {"f.png": "bad_mask", "g.png": "bad_mask", "h.png": "bad_mask",
                       "zz-masklabel.png": "orphan_mask"}
    details = {r["path"]: r["detail"] for r in result.rejected}
    assert "f.png is 64x64, its image 96x96" in details["f.png"]
    assert "all black" in details["g.png"] and "not a readable image" in details["h.png"]
    rows = result.by_path()
    assert set(rows) == {"a.png", "sub/b.png", "c.png", "d.png", "e.png"}  # nothing under masks/ is an image
    assert {p: r["mask_source"] for p, r in rows.items()} == {
        "a.png": "file", "sub/b.png": "file", "c.png": "masklabel", "d.png": "alpha", "e.png": None}
    assert rows["e.png"]["mask_file_name"] is None
    assert result.summary.report()["masks_by_source"] == {"file": 2, "masklabel": 1, "alpha": 1, "generated": 0}
    for path in ("a.png", "sub/b.png", "c.png", "d.png"):
        row = rows[path]
        assert row["mask_file_name"] == f"masks/{Path(row['file_name']).stem}.png"
        mask = Image.open(result.out / row["mask_file_name"])
        assert mask.mode == "L" and mask.size == result.image(row).size == (64, 64)
    # a.png, 128x96 with the subject in columns 40..88: resized to 85x64, centre-cropped by 10 px
    a = np.asarray(Image.open(result.out / rows["a.png"]["mask_file_name"])) > 127
    cols = np.flatnonzero(a.any(axis=0))
    assert a.all(axis=0)[cols].all()
    assert abs(cols[0] - (40 * 64 / 96 - 10)) <= 1 and abs(cols[-1] + 1 - (88 * 64 / 96 - 10)) <= 1
    c = np.asarray(Image.open(result.out / rows["c.png"]["mask_file_name"])) > 127
    assert abs(np.flatnonzero(c.any(axis=1))[-1] + 1 - 20) <= 1  # top 30 of 96 rows -> 20 of 64
    # the composited RGB of d.png stays an RGB image (the alpha went into the mask)
    assert result.image(rows["d.png"]).mode == "RGB"
    lines = [json.loads(x) for x in (result.out / "metadata.jsonl").read_text().splitlines()]
    assert all("mask_file_name" in row and "mask_source" in row for row in lines)


def test_a_changed_mask_is_not_served_from_the_cache(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    save(root / "a.png", picture(1))
    save(root / "a-masklabel.png", _mask((96, 96), (0, 0, 48, 96)))
    cfg = config(root, cache_dir=str(tmp_path / "cache"), invert_mask=True, mask_min_value=0.25)
    first = run(cfg, tmp_path / "out1")
    save(root / "a-masklabel.png", _mask((96, 96), (48, 0, 96, 96)))
    second = run(cfg, tmp_path / "out2")
    m1, m2 = (np.asarray(Image.open(r.out / r.kept[0]["mask_file_name"])) for r in (first, second))
    assert second.summary.cache_hits == 0 and not np.array_equal(m1, m2)
    assert m1[:, :20].min() == round(0.25 * 255) and m1[:, -20:].min() == 255  # inverted, floor 0.25
    third = run(cfg, tmp_path / "out3")
    assert third.summary.cache_hits == 1
    assert np.array_equal(np.asarray(Image.open(third.out / third.kept[0]["mask_file_name"])), m2)


def test_a_missing_mask_dir_is_a_user_error(tmp_path: Path) -> None:
    from tasks.common.errors import UserError

    save(tmp_path / "ds" / "a.png", picture(1))
    with pytest.raises(UserError, match=r"sources\.0\.mask_dir"):
        run(config([{"type": "folder", "path": str(tmp_path / "ds"), "mask_dir": "masks"}]), tmp_path / "out")


def test_an_imagefolder_reads_masklabels_beside_its_images(tmp_path: Path) -> None:
    root = tmp_path / "hf"
    save(root / "a.png", picture(1))
    save(root / "a-masklabel.png", _mask((96, 96), (0, 0, 48, 96)))
    save(root / "b.png", picture(2))
    save(root / "c-masklabel.png", _mask((96, 96), (0, 0, 48, 96)))
    (root / "metadata.jsonl").write_text('{"file_name": "a.png", "text": "a"}\n{"file_name": "b.png", "text": "b"}\n')
    result = run(config([{"type": "imagefolder", "path": str(root)}]), tmp_path / "out")
    assert result.reasons() == {"c-masklabel.png": "orphan_mask"}
    assert {p: r["mask_source"] for p, r in result.by_path().items()} == {"a.png": "masklabel", "b.png": None}
