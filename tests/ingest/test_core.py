"""The ingest core on small folders built in tmp_path: normalising, checks, duplicates, captions."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from PIL import Image

from tasks.common.errors import UserError
from tasks.ingest.core import require_kept
from tests.ingest.util import picture, run_folder, save

pytestmark = pytest.mark.quick  # make test-fast

RED, BLUE = (255, 0, 0), (0, 0, 255)
SOLID = {"near_duplicate_distance": None}  # solid colours share one perceptual hash


def only_rejection(run) -> dict:
    assert len(run.rejected) == 1, run.rejected
    return run.rejected[0]


def test_good_image_is_kept_and_normalised(tmp_path: Path) -> None:
    src = tmp_path / "src"
    path = save(src / "toy.png", Image.new("RGB", (100, 80), RED), caption="a photo of sks toy\n")
    r = run_folder(src, tmp_path / "out", resolution=48)
    assert not r.rejected and r.summary.total == 1
    (row,) = r.kept
    assert row["text"] == "a photo of sks toy" and row["caption_source"] == "file"
    assert (row["source"], row["path"]) == (str(src), "toy.png")
    assert row["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert (row["width"], row["height"]) == (48, 48)
    assert (row["source_width"], row["source_height"]) == (100, 80)
    assert row["tags"] == [] and row["score"] is None and len(row["phash"]) == 16
    out = r.image(row)
    assert out.mode == "RGB" and out.size == (48, 48) and out.getpixel((24, 24)) == RED


def test_output_sizes_and_jpeg_output(tmp_path: Path) -> None:
    src = tmp_path / "src"
    save(src / "wide.png", picture(1, (120, 80)))
    square = run_folder(src, tmp_path / "a", resolution=40).kept[0]
    short = run_folder(src, tmp_path / "b", resolution=40, output_size="short_side").kept[0]
    source = run_folder(src, tmp_path / "c", output_size="source", output_format="jpeg").kept[0]
    assert (square["width"], square["height"]) == (40, 40)
    assert (short["width"], short["height"]) == (60, 40)
    assert (source["width"], source["height"]) == (120, 80)
    assert source["file_name"].endswith(".jpg")
    assert Image.open(tmp_path / "c" / source["file_name"]).format == "JPEG"


def test_whole_images_carry_the_size_the_train_stage_buckets_by(tmp_path: Path) -> None:
    """short_side keeps portrait and landscape whole; metadata.jsonl's width/height are the files'
    (the train stage's bucketing reads them instead of opening every image)."""
    from tasks.train.data import read_imagefolder

    src = tmp_path / "src"
    save(src / "tall.png", picture(3, (80, 120)), caption="tall")
    save(src / "wide.png", picture(4, (120, 80)), caption="wide")
    run = run_folder(src, tmp_path / "out", resolution=40, output_size="short_side")
    records = {r.text: r for r in read_imagefolder(tmp_path / "out", "images", "")}
    assert records["tall"].size == (60, 40) and records["wide"].size == (40, 60), "(height, width)"
    for row in run.kept:
        assert Image.open(tmp_path / "out" / row["file_name"]).size == (row["width"], row["height"])


def test_jpeg_is_decoded_at_reduced_scale_with_the_same_result_size(tmp_path: Path) -> None:
    src = tmp_path / "src"
    save(src / "big.jpg", picture(2, (800, 600)), quality=90)
    r = run_folder(src, tmp_path / "out", resolution=64)
    (row,) = r.kept
    assert (row["width"], row["height"], row["source_width"], row["source_height"]) == (64, 64, 800, 600)


@pytest.mark.parametrize(
    ("name", "make", "reason"),
    [
        ("zero.png", lambda p: p.write_bytes(b""), "empty_file"),
        ("text.png", lambda p: p.write_text("hello, I am not a picture\n" * 20), "not_an_image"),
        ("notes.md", lambda p: p.write_text("# readme"), "unsupported_extension"),
        ("orphan.txt", lambda p: p.write_text("a caption without its image"), "orphan_caption"),
        ("tiny.png", lambda p: Image.new("RGB", (20, 200), RED).save(p), "too_small"),
        ("wide.png", lambda p: Image.new("RGB", (500, 100), RED).save(p), "aspect_ratio"),
        ("loop.png", lambda p: p.symlink_to(p.name), "unreadable"),
    ],
)
def test_bad_file_is_rejected_with_reason(tmp_path: Path, name: str, make, reason: str) -> None:
    src = tmp_path / "src"
    src.mkdir()
    make(src / name)
    row = only_rejection(run_folder(src, tmp_path / "out"))
    assert (row["path"], row["reason"]) == (name, reason) and row["detail"]


def test_truncated_png_is_corrupt(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    Image.effect_noise((200, 200), 64).convert("RGB").save(tmp_path / "full.png")
    data = (tmp_path / "full.png").read_bytes()
    (src / "cut.png").write_bytes(data[: len(data) // 2])
    row = only_rejection(run_folder(src, tmp_path / "out"))
    assert row["reason"] == "corrupt" and "truncated" in row["detail"]


@pytest.mark.parametrize("size", [(40, 40), (100, 100)])  # PIL's warning band and its error band
def test_too_many_pixels_is_rejected_before_decoding(tmp_path: Path, size: tuple[int, int]) -> None:
    src = tmp_path / "src"
    save(src / "big.png", Image.new("RGB", size, RED))
    saved_limit = Image.MAX_IMAGE_PIXELS
    row = only_rejection(run_folder(src, tmp_path / "out", max_pixels=1000))
    assert row["reason"] == "too_large"
    assert saved_limit == Image.MAX_IMAGE_PIXELS  # the global limit is restored


def test_modes_are_converted_to_rgb_on_the_background(tmp_path: Path) -> None:
    src = tmp_path / "src"
    save(src / "rgba.png", Image.new("RGBA", (64, 64), (255, 0, 0, 0)))  # transparent
    save(src / "cmyk.jpg", Image.new("CMYK", (64, 64), (0, 255, 255, 0)), quality=95)  # red ink
    pal = Image.new("P", (64, 64), 0)
    pal.putpalette([0, 0, 255] + [0, 0, 0] * 255)
    save(src / "pal.png", pal)
    save(src / "pal_t.png", pal.copy(), transparency=0)  # palette entry 0 transparent
    save(src / "grey16.png", Image.new("I;16", (64, 64), 65535))  # 16-bit white, not clipped
    save(src / "mid16.png", Image.new("I;16", (64, 64), 32768))
    save(src / "la.png", Image.new("LA", (64, 64), (0, 255)))  # opaque black
    r = run_folder(src, tmp_path / "out", background=[0, 128, 0], **SOLID)
    assert not r.rejected
    pixels = {row["path"]: r.image(row).convert("RGB").getpixel((32, 32)) for row in r.kept}
    assert all(r.image(row).mode == "RGB" for row in r.kept)
    assert pixels["rgba.png"] == (0, 128, 0) and pixels["pal_t.png"] == (0, 128, 0)
    assert pixels["pal.png"] == BLUE and pixels["la.png"] == (0, 0, 0)
    assert pixels["grey16.png"] == (255, 255, 255)
    assert all(abs(c - 128) <= 1 for c in pixels["mid16.png"])
    red, green, blue = pixels["cmyk.jpg"]
    assert red > 200 and green < 60 and blue < 60


def test_exif_orientation_is_applied(tmp_path: Path) -> None:
    """Stored 80x40, red left, blue right; EXIF 8 (turn 90 CCW) shows it 40x80, blue on top."""
    src = tmp_path / "src"
    im = Image.new("RGB", (80, 40), RED)
    im.paste(BLUE, (40, 0, 80, 40))
    exif = Image.Exif()
    exif[0x0112] = 8
    save(src / "rotated.jpg", im, exif=exif.tobytes(), quality=95)
    r = run_folder(src, tmp_path / "out", resolution=32, center_crop=False)
    (row,) = r.kept
    assert (row["source_width"], row["source_height"]) == (40, 80)
    red, _, blue = r.image(row).getpixel((16, 8))
    assert blue > 200 and red < 60, "top-left crop of the upright image is the blue half"
    save(src / "rotated.jpg", im, quality=95)  # without the tag: red, so the rotation mattered
    r2 = run_folder(src, tmp_path / "out2", resolution=32, center_crop=False)
    red, _, blue = r2.image(r2.kept[0]).getpixel((16, 8))
    assert red > 200 and blue < 60


def test_center_and_top_left_crop(tmp_path: Path) -> None:
    src = tmp_path / "src"
    im = Image.new("RGB", (96, 32), RED)
    im.paste(BLUE, (32, 0, 64, 32))  # blue in the middle third
    save(src / "strip.png", im)
    centre = run_folder(src, tmp_path / "c", resolution=32, center_crop=True)
    corner = run_folder(src, tmp_path / "t", resolution=32, center_crop=False)
    assert centre.image(centre.kept[0]).getpixel((16, 16)) == BLUE
    assert corner.image(corner.kept[0]).getpixel((16, 16)) == RED


def test_exact_and_near_duplicates_name_the_kept_file(tmp_path: Path) -> None:
    src = tmp_path / "src"
    save(src / "a.png", picture(1))
    (src / "copy").mkdir()
    (src / "copy" / "z.png").write_bytes((src / "a.png").read_bytes())
    save(src / "b.jpg", picture(1), quality=85)  # same picture, other bytes
    save(src / "c.png", picture(2))
    r = run_folder(src, tmp_path / "out")
    assert [row["path"] for row in r.kept] == ["a.png", "c.png"]
    rows = {row["path"]: row for row in r.rejected}
    assert rows["copy/z.png"]["reason"] == "duplicate"
    assert rows["copy/z.png"]["duplicate_of"] == f"{src}/a.png"
    assert rows["b.jpg"]["reason"] == "near_duplicate"
    assert rows["b.jpg"]["duplicate_of"] == f"{src}/a.png" and rows["b.jpg"]["distance"] <= 4
    off = run_folder(src, tmp_path / "off", near_duplicate_distance=None)
    assert off.reasons() == {"copy/z.png": "duplicate"}


def test_same_stem_in_two_folders_gives_two_outputs(tmp_path: Path) -> None:
    src = tmp_path / "src"
    save(src / "x" / "img.png", picture(1), caption="red")
    save(src / "y" / "img.png", picture(2), caption="blue")
    r = run_folder(src, tmp_path / "out")
    assert sorted(row["text"] for row in r.kept) == ["blue", "red"]
    assert len({row["file_name"] for row in r.kept}) == 2
    assert len(list(r.out.glob("*.png"))) == 2


@pytest.mark.timeout(30)
def test_symlinks_outside_root_are_rejected_without_reading(tmp_path: Path) -> None:
    src, outside = tmp_path / "src", tmp_path / "outside"
    outside.mkdir()
    # A FIFO: opening it for reading would block forever, so passing proves it was never read.
    os.mkfifo(outside / "trap.png")
    save(outside / "real.png", picture(9))
    save(src / "inside.png", picture(1))
    (src / "escape.png").symlink_to(outside / "trap.png")
    (src / "escape2.png").symlink_to(Path("..") / "outside" / "real.png")
    (src / "dirlink").symlink_to(outside, target_is_directory=True)
    (src / "inner.png").symlink_to(src / "inside.png")  # inside the root: read, then a duplicate
    (src / "dangling.png").symlink_to(src / "nothing.png")
    save(src / "capt.png", picture(2))
    (src / "capt.txt").symlink_to(outside / "trap.png")  # caption leaving the root
    r = run_folder(src, tmp_path / "out")
    assert r.reasons() == {
        "escape.png": "outside_root",
        "escape2.png": "outside_root",
        "dirlink": "outside_root",
        "capt.png": "outside_root",
        "inner.png": "duplicate",
        "dangling.png": "broken_symlink",
    }
    assert [row["path"] for row in r.kept] == ["inside.png"]


def test_caption_sidecars_extensions_and_instance_prompt(tmp_path: Path) -> None:
    src = tmp_path / "src"
    save(src / "a.png", picture(1))
    (src / "a.caption").write_text("from a .caption file")
    save(src / "b.png", picture(2))
    (src / "b.TXT").write_text("upper-case extension")
    save(src / "c.png", picture(3), caption="\ufeffa photo\nof  sks toy\n")
    texts = {row["path"]: row["text"] for row in run_folder(src, tmp_path / "o").kept}
    assert texts == {"a.png": "from a .caption file", "b.png": "upper-case extension",
                     "c.png": "a photo of sks toy"}
    prompt = [{"type": "folder", "path": str(src), "instance_prompt": "a photo of zwx dog"}]
    from tests.ingest.util import config, run

    r = run(config(prompt), tmp_path / "p")
    assert {row["text"] for row in r.kept} == {"a photo of zwx dog"}
    assert {row["caption_source"] for row in r.kept} == {"instance_prompt"} and not r.rejected


def test_caption_policies(tmp_path: Path) -> None:
    src = tmp_path / "src"
    save(src / "none.png", picture(1))
    save(src / "blank.png", picture(2), caption="  \n")
    save(src / "long.png", picture(3), caption=" ".join(f"w{i}" for i in range(12)))
    save(src / "ok.png", picture(4), caption="short one")
    fallback = run_folder(src, tmp_path / "a", captions={"fallback": "zwx", "max_words": 5})
    texts = {row["path"]: row["text"] for row in fallback.kept}
    assert texts == {"none.png": "zwx", "blank.png": "zwx", "long.png": "w0 w1 w2 w3 w4",
                     "ok.png": "short one"}
    assert fallback.by_path()["long.png"]["caption_truncated"] is True
    report = fallback.summary.report()
    assert report["captions_from_fallback"] == 2 and report["captions_truncated"] == 1
    drop = run_folder(src, tmp_path / "b", captions={"empty": "drop", "max_words": 5,
                                                     "too_long": "drop"})
    assert drop.reasons() == {"none.png": "empty_caption", "blank.png": "empty_caption",
                              "long.png": "long_caption"}
    use_fallback = run_folder(src, tmp_path / "c", captions={"max_words": 5, "too_long": "fallback"})
    assert use_fallback.by_path()["long.png"]["text"] == "a photo of sks toy"


def test_no_usable_images_is_a_user_error(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "zero.png").write_bytes(b"")
    r = run_folder(src, tmp_path / "out")
    with pytest.raises(UserError, match=r"no usable images .*empty_file"):
        require_kept(r.summary)


def test_missing_source_names_key_and_fix(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"sources\.0\.path: .*data/demo/subject does not exist.*make data"):
        run_folder(tmp_path / "data" / "demo" / "subject", tmp_path / "out")
    with pytest.raises(UserError, match=r"elsewhere does not exist. Check the path"):
        run_folder(tmp_path / "elsewhere", tmp_path / "out")
    (tmp_path / "file.png").write_bytes(b"x")
    with pytest.raises(UserError, match="is not a folder"):
        run_folder(tmp_path / "file.png", tmp_path / "out")


def test_a_file_that_already_is_the_output_passes_through_unchanged(tmp_path: Path) -> None:
    src = tmp_path / "src"
    plain = save(src / "plain.jpg", picture(1, (64, 64)), quality=90)
    exif = Image.Exif()
    exif[0x010F] = "camera maker"
    tagged = save(src / "tagged.jpg", picture(2, (64, 64)), quality=90, exif=exif.tobytes())
    r = run_folder(src, tmp_path / "out", output_format="jpeg", resolution=64)
    rows = r.by_path()
    assert (r.out / rows["plain.jpg"]["file_name"]).read_bytes() == plain.read_bytes()
    # EXIF is never carried into the processed set: that file is decoded and re-encoded
    out_tagged = r.image(rows["tagged.jpg"])
    assert "exif" not in out_tagged.info and out_tagged.size == (64, 64)
    assert (r.out / rows["tagged.jpg"]["file_name"]).read_bytes() != tagged.read_bytes()
    as_png = run_folder(src, tmp_path / "png", resolution=64)  # another format: re-encoded
    assert as_png.image(as_png.by_path()["plain.jpg"]).format == "PNG"
