"""The ingest core on small corpora built in tmp_path: every kind of file ends kept or rejected."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from PIL import Image

from tasks.common.config import parse_section
from tasks.common.errors import UserError
from tasks.ingest.checks import REASONS
from tasks.ingest.config import IngestConfig
from tasks.ingest.core import METADATA, Summary, ingest, require_kept

RED, BLUE = (255, 0, 0), (0, 0, 255)


def cfg(source: Path, **overrides) -> IngestConfig:
    return IngestConfig(source=source, **overrides)


def save(path: Path, image: Image.Image, caption: str | None = None, **save_kw) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, **save_kw)
    if caption is not None:
        path.with_suffix(".txt").write_text(caption)
    return path


def run(source: Path, out: Path, **overrides) -> Summary:
    out.mkdir(parents=True, exist_ok=True)
    return ingest(cfg(source, **overrides), out)


def only_rejection(summary: Summary) -> dict:
    assert len(summary.rejected) == 1, summary.rejected
    return summary.rejected[0]


def metadata(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / METADATA).read_text().splitlines()]


def test_good_image_is_kept_and_normalised(tmp_path: Path) -> None:
    src = tmp_path / "src"
    path = save(src / "toy.png", Image.new("RGB", (100, 80), RED), caption="a photo of sks toy\n")
    s = run(src, tmp_path / "out", resolution=48)
    assert not s.rejected and s.total == 1
    (row,) = metadata(tmp_path / "out")
    assert row["text"] == "a photo of sks toy" and row["caption_source"] == "file"
    assert row["source"] == "toy.png"
    assert row["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert (row["width"], row["height"]) == (48, 48)
    assert (row["source_width"], row["source_height"]) == (100, 80)
    out = Image.open(tmp_path / "out" / row["file_name"])
    assert out.mode == "RGB" and out.size == (48, 48)
    assert out.getpixel((24, 24)) == RED


def test_missing_or_empty_caption_uses_fallback(tmp_path: Path) -> None:
    src = tmp_path / "src"
    save(src / "a.png", Image.new("RGB", (64, 64), RED))
    save(src / "b.png", Image.new("RGB", (64, 64), BLUE), caption="  \n")
    s = run(src, tmp_path / "out", caption_fallback="a photo of zzz dog")
    assert [r["text"] for r in s.kept] == ["a photo of zzz dog"] * 2
    assert s.report()["captions_from_fallback"] == 2


def test_caption_whitespace_is_collapsed(tmp_path: Path) -> None:
    src = tmp_path / "src"
    save(src / "a.png", Image.new("RGB", (64, 64), RED), caption="\ufeffa photo\nof  sks toy\n")
    assert run(src, tmp_path / "out").kept[0]["text"] == "a photo of sks toy"


@pytest.mark.parametrize(
    ("name", "make", "reason"),
    [
        ("zero.png", lambda p: p.write_bytes(b""), "empty_file"),
        ("text.png", lambda p: p.write_text("hello, I am not a picture\n" * 20), "not_an_image"),
        ("notes.md", lambda p: p.write_text("# readme"), "unsupported_extension"),
        ("orphan.txt", lambda p: p.write_text("a caption without its image"), "orphan_caption"),
        ("tiny.png", lambda p: Image.new("RGB", (20, 200), RED).save(p), "too_small"),
        ("wide.png", lambda p: Image.new("RGB", (500, 100), RED).save(p), "aspect_ratio"),
    ],
)
def test_bad_file_is_rejected_with_reason(tmp_path: Path, name: str, make, reason: str) -> None:
    src = tmp_path / "src"
    src.mkdir()
    make(src / name)
    s = run(src, tmp_path / "out")
    row = only_rejection(s)
    assert (row["path"], row["reason"]) == (name, reason)
    assert row["detail"]


def test_truncated_png_is_corrupt(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    Image.effect_noise((200, 200), 64).convert("RGB").save(tmp_path / "full.png")
    data = (tmp_path / "full.png").read_bytes()
    (src / "cut.png").write_bytes(data[: len(data) // 2])
    row = only_rejection(run(src, tmp_path / "out"))
    assert row["reason"] == "corrupt" and "truncated" in row["detail"]


@pytest.mark.parametrize("size", [(40, 40), (100, 100)])  # PIL's warning band and its error band
def test_too_many_pixels_is_rejected_before_decoding(tmp_path: Path, size: tuple[int, int]) -> None:
    src = tmp_path / "src"
    save(src / "big.png", Image.new("RGB", size, RED))
    saved_limit = Image.MAX_IMAGE_PIXELS
    row = only_rejection(run(src, tmp_path / "out", max_pixels=1000))
    assert row["reason"] == "too_large"
    assert Image.MAX_IMAGE_PIXELS == saved_limit  # the global limit is restored


def test_modes_are_converted_to_rgb(tmp_path: Path) -> None:
    src = tmp_path / "src"
    rgba = Image.new("RGBA", (64, 64), (255, 0, 0, 0))  # fully transparent red -> white
    save(src / "rgba.png", rgba)
    save(src / "cmyk.jpg", Image.new("CMYK", (64, 64), (0, 255, 255, 0)), quality=95)  # red ink
    pal = Image.new("P", (64, 64), 0)
    pal.putpalette([0, 0, 255] + [0, 0, 0] * 255)
    save(src / "pal.png", pal)
    pal_t = pal.copy()
    save(src / "pal_t.png", pal_t, transparency=0)  # palette entry 0 transparent -> white
    save(src / "grey16.png", Image.new("I;16", (64, 64), 65535))  # 16-bit white, not clipped
    save(src / "mid16.png", Image.new("I;16", (64, 64), 32768))
    save(src / "la.png", Image.new("LA", (64, 64), (0, 255)))  # opaque black
    s = run(src, tmp_path / "out")
    assert not s.rejected
    pixels = {}
    for row in s.kept:
        im = Image.open(tmp_path / "out" / row["file_name"])
        assert im.mode == "RGB"
        pixels[row["source"]] = im.getpixel((32, 32))
    assert pixels["rgba.png"] == (255, 255, 255)
    assert pixels["pal.png"] == BLUE
    assert pixels["pal_t.png"] == (255, 255, 255)
    assert pixels["grey16.png"] == (255, 255, 255)
    assert all(abs(c - 128) <= 1 for c in pixels["mid16.png"])
    assert pixels["la.png"] == (0, 0, 0)
    r, g, b = pixels["cmyk.jpg"]
    assert r > 200 and g < 60 and b < 60


def test_exif_orientation_is_applied(tmp_path: Path) -> None:
    """Stored 80x40, red left, blue right; EXIF 8 (turn 90 CCW) shows it 40x80, blue on top."""
    src = tmp_path / "src"
    im = Image.new("RGB", (80, 40), RED)
    im.paste(BLUE, (40, 0, 80, 40))
    exif = Image.Exif()
    exif[0x0112] = 8
    save(src / "rotated.jpg", im, exif=exif.tobytes(), quality=95)
    s = run(src, tmp_path / "out", resolution=32, center_crop=False)
    (row,) = s.kept
    out = Image.open(tmp_path / "out" / row["file_name"])
    r, g, b = out.getpixel((16, 8))
    assert b > 200 and r < 60, "top-left crop of the upright image is the blue half"
    # Without the EXIF tag the same pixels give red: the rotation is what changed the result.
    save(src / "rotated.jpg", im, quality=95)
    s2 = run(src, tmp_path / "out2", resolution=32, center_crop=False)
    r, g, b = Image.open(tmp_path / "out2" / s2.kept[0]["file_name"]).getpixel((16, 8))
    assert r > 200 and b < 60


def test_center_and_top_left_crop(tmp_path: Path) -> None:
    src = tmp_path / "src"
    im = Image.new("RGB", (96, 32), RED)
    im.paste(BLUE, (32, 0, 64, 32))  # blue in the middle third
    save(src / "strip.png", im)
    centre = run(src, tmp_path / "c", resolution=32, center_crop=True).kept[0]
    corner = run(src, tmp_path / "t", resolution=32, center_crop=False).kept[0]
    assert Image.open(tmp_path / "c" / centre["file_name"]).getpixel((16, 16)) == BLUE
    assert Image.open(tmp_path / "t" / corner["file_name"]).getpixel((16, 16)) == RED


def test_duplicate_names_the_kept_file(tmp_path: Path) -> None:
    src = tmp_path / "src"
    save(src / "a.png", Image.new("RGB", (64, 64), RED))
    (src / "copy").mkdir()
    (src / "copy" / "z.png").write_bytes((src / "a.png").read_bytes())
    s = run(src, tmp_path / "out")
    assert [r["source"] for r in s.kept] == ["a.png"]
    row = only_rejection(s)
    assert row == {
        "path": "copy/z.png",
        "reason": "duplicate",
        "detail": "same bytes as a.png",
        "duplicate_of": "a.png",
    }


def test_same_stem_in_two_folders_gives_two_outputs(tmp_path: Path) -> None:
    src = tmp_path / "src"
    save(src / "x" / "img.png", Image.new("RGB", (64, 64), RED), caption="red")
    save(src / "y" / "img.png", Image.new("RGB", (64, 64), BLUE), caption="blue")
    s = run(src, tmp_path / "out")
    assert sorted(r["text"] for r in s.kept) == ["blue", "red"]
    assert len({r["file_name"] for r in s.kept}) == 2
    assert len(list((tmp_path / "out").glob("*.png"))) == 2


@pytest.mark.timeout(30)
def test_symlinks_outside_root_are_rejected_without_reading(tmp_path: Path) -> None:
    src, outside = tmp_path / "src", tmp_path / "outside"
    outside.mkdir()
    # A FIFO: opening it for reading would block forever, so passing proves it was never read.
    os.mkfifo(outside / "trap.png")
    save(outside / "real.png", Image.new("RGB", (64, 64), RED))
    save(src / "inside.png", Image.new("RGB", (64, 64), BLUE))
    (src / "escape.png").symlink_to(outside / "trap.png")
    (src / "escape2.png").symlink_to(Path("..") / "outside" / "real.png")
    (src / "dirlink").symlink_to(outside, target_is_directory=True)
    (src / "inner.png").symlink_to(src / "inside.png")  # inside the root: read, then a duplicate
    (src / "dangling.png").symlink_to(src / "nothing.png")
    save(src / "capt.png", Image.new("RGB", (64, 64), RED))
    (src / "capt.txt").symlink_to(outside / "trap.png")  # caption leaving the root
    s = run(src, tmp_path / "out")
    reasons = {r["path"]: r["reason"] for r in s.rejected}
    assert reasons == {
        "escape.png": "symlink_outside_root",
        "escape2.png": "symlink_outside_root",
        "dirlink": "symlink_outside_root",
        "capt.png": "symlink_outside_root",
        "inner.png": "duplicate",
        "dangling.png": "broken_symlink",
    }
    assert [r["source"] for r in s.kept] == ["inside.png"]


def test_counts_add_up_over_a_mixed_corpus(tmp_path: Path) -> None:
    src = tmp_path / "src"
    for i, color in enumerate([RED, BLUE, (0, 255, 0)]):
        save(src / f"good{i}.png", Image.new("RGB", (64 + i, 64), color), caption=f"good {i}")
    (src / "dup.png").write_bytes((src / "good0.png").read_bytes())
    (src / "zero.jpg").write_bytes(b"")
    (src / "fake.webp").write_text("nope")
    save(src / "sub" / "tiny.png", Image.new("RGB", (8, 8), RED))
    (src / "sub" / "stray.txt").write_text("orphan")
    (src / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    inputs = {p.relative_to(src).as_posix() for p in src.rglob("*") if p.is_file()}
    inputs -= {f"good{i}.txt" for i in range(3)}  # captions travel with their images
    s = run(src, tmp_path / "out")
    report = s.report()
    assert report["total"] == len(inputs) == 9
    assert report["kept"] + report["rejected"] == report["total"]
    assert sum(report["rejected_by_reason"].values()) == report["rejected"] == 6
    assert set(report["rejected_by_reason"]) == set(REASONS)
    accounted = [r["source"] for r in s.kept] + [r["path"] for r in s.rejected]
    assert sorted(accounted) == sorted(inputs)
    assert len(metadata(tmp_path / "out")) == report["kept"] == 3


def test_missing_source_names_path_and_fix(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"data/demo/subject does not exist.*make data"):
        run(tmp_path / "data" / "demo" / "subject", tmp_path / "out")
    with pytest.raises(UserError, match=r"elsewhere does not exist.*set ingest.source"):
        run(tmp_path / "elsewhere", tmp_path / "out")
    (tmp_path / "file.png").write_bytes(b"x")
    with pytest.raises(UserError, match="is not a folder"):
        run(tmp_path / "file.png", tmp_path / "out")


def test_no_usable_images_is_a_user_error(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "zero.png").write_bytes(b"")
    s = run(src, tmp_path / "out")
    with pytest.raises(UserError, match=r"no usable images in .*empty_file"):
        require_kept(s, src)


def test_config_errors_name_the_key(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"ingest\.resolution"):
        parse_section("ingest", {"resolution": 0}, IngestConfig)
    with pytest.raises(UserError, match=r"ingest\.min_sidee: unknown key"):
        parse_section("ingest", {"min_sidee": 3}, IngestConfig)
    with pytest.raises(UserError, match=r"ingest\.max_aspect_ratio"):
        parse_section("ingest", {"max_aspect_ratio": 0.5}, IngestConfig)
