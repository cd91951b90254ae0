"""A generated corpus of bad and awkward inputs, with the expected fate of each.

`build(root)` writes five sources (a captioned folder, a JSON-metadata dataset, an imagefolder, an
edit folder with references, a clips folder)
and returns the params for them and `expected`: {(source label, path): reason or "kept"}. Every
rejection reason in checks.REASONS occurs at least once.
"""
from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

from PIL import Image

from tasks.ingest.checks import CAPTION_MAX_BYTES
from tests.ingest.clip_util import audio_only, frame, hours_long_header, make_clip, truncated, zero_frames
from tests.ingest.util import bomb_png, picture, save

PARAMS: dict[str, Any] = {
    "max_pixels": 4_000_000,
    "captions": {"fallback": "a photo of sks toy", "empty": "drop", "max_words": 20,
                 "too_long": "drop"},
    # clips: the baseline of the decoding child (Python, PyAV) is about 180 MiB here, a 4K frame's
    # decoding about 320 MiB: the 4K clip passes the cap, the small ones do not
    "video": {"decode_memory_mb": 256, "resolution": 64},
}


def _png(image: Image.Image, **kw: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG", **kw)
    return buf.getvalue()


def build(root: Path) -> tuple[list[dict], dict[tuple[str, str], str]]:
    expected: dict[tuple[str, str], str] = {}
    folder, meta, hf, outside = root / "photos", root / "booru", root / "hf", root / "outside"
    outside.mkdir(parents=True)
    save(outside / "secret.png", picture(900))
    f, m, h = str(folder), str(meta), str(hf)

    def photo(rel: str, reason: str, seed: int, caption: str | None = "a photo", **kw: Any) -> None:
        save(folder / rel, picture(seed, kw.pop("size", (96, 96)), kw.pop("mode", "RGB")),
             **kw)
        if caption is not None:
            (folder / rel).with_suffix(".txt").write_text(caption, encoding="utf-8")
        expected[(f, rel)] = reason

    # awkward but fine
    photo("plain.png", "kept", 1)
    photo("ünïcödé 名前 with spaces.jpg", "kept", 2, quality=92)
    photo("a/same name.png", "kept", 3)
    photo("b/same name.png", "kept", 4)  # the same name in another folder
    photo("deep/er/still/cmyk.jpg", "kept", 5, mode="CMYK", quality=90)
    photo("modes/rgba.png", "kept", 6, mode="RGBA")
    photo("modes/la.png", "kept", 7, mode="LA")
    photo("modes/p.png", "kept", 8, mode="P")
    exif = Image.Exif()
    exif[0x0112] = 6
    photo("rotated.jpg", "kept", 9, size=(120, 90), exif=exif.tobytes())
    # every way a folder input fails
    photo("caption/none.png", "empty_caption", 10, caption=None)
    photo("caption/blank.png", "empty_caption", 11, caption=" \n\t")
    photo("caption/long.png", "long_caption", 12, caption=" ".join(["word"] * 30))
    photo("caption/huge.png", "oversized_file", 16, caption="word " * (CAPTION_MAX_BYTES // 5 + 1))
    photo("pixels/tiny.png", "too_small", 13, size=(20, 20))
    photo("pixels/banner.png", "aspect_ratio", 14, size=(500, 100))
    (folder / "pixels").mkdir(exist_ok=True)
    (folder / "pixels/bomb.png").write_bytes(_png(Image.new("1", (3000, 2000))))
    expected[(f, "pixels/bomb.png")] = "too_large"
    (folder / "pixels/zero.jpg").write_bytes(b"")
    expected[(f, "pixels/zero.jpg")] = "empty_file"
    os.mkfifo(folder / "pixels/pipe.png")  # opening it to read would block for ever: never opened
    expected[(f, "pixels/pipe.png")] = "not_regular_file"
    (folder / "pixels/fake.webp").write_text("I am text")
    expected[(f, "pixels/fake.webp")] = "not_an_image"
    whole = _png(picture(15, (200, 200)))
    (folder / "pixels/cut.png").write_bytes(whole[: len(whole) // 2])
    expected[(f, "pixels/cut.png")] = "corrupt"
    (folder / "dups").mkdir()
    (folder / "dups/copy.png").write_bytes((folder / "plain.png").read_bytes())
    (folder / "dups/copy.txt").write_text("a copy")
    expected[(f, "dups/copy.png")] = "duplicate"
    save(folder / "dups/recompressed.jpg", picture(1), quality=80)
    (folder / "dups/recompressed.txt").write_text("the same picture, other bytes")
    expected[(f, "dups/recompressed.jpg")] = "near_duplicate"
    (folder / "notes.md").write_text("# notes")
    expected[(f, "notes.md")] = "unsupported_extension"
    (folder / "stray.caption").write_text("nobody's caption")
    expected[(f, "stray.caption")] = "orphan_caption"
    photo("masked/kept.png", "kept", 13)  # a OneTrainer mask beside it
    save(folder / "masked/kept-masklabel.png", Image.new("L", (96, 96), 200))
    photo("masked/small.png", "bad_mask", 14)  # its mask is not its size
    save(folder / "masked/small-masklabel.png", Image.new("L", (48, 48), 255))
    photo("masked/bomb.png", "bad_mask", 17)  # its mask claims 182 million pixels: never decoded
    (folder / "masked/bomb-masklabel.png").write_bytes(bomb_png(14_000, 13_000))
    save(folder / "masked/alone-masklabel.png", Image.new("L", (96, 96), 255))
    expected[(f, "masked/alone-masklabel.png")] = "orphan_mask"
    (folder / "escape.png").symlink_to(outside / "secret.png")
    expected[(f, "escape.png")] = "outside_root"
    (folder / "outdir").symlink_to(outside, target_is_directory=True)
    expected[(f, "outdir")] = "outside_root"
    (folder / "dangling.png").symlink_to(folder / "nowhere.png")
    expected[(f, "dangling.png")] = "broken_symlink"
    (folder / "loop.png").symlink_to("loop.png")
    expected[(f, "loop.png")] = "unreadable"

    # the JSON metadata layout (seed 003), every rule once
    def entry(name: str, reason: str, **data: Any) -> None:
        path = meta / "metadata" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(data.pop("raw", None) or json.dumps(data))
        expected[(m, f"metadata/{name}")] = reason

    for i in range(4):
        save(meta / "images" / f"{i}.png", picture(100 + i))
    entry("0/keep.json", "kept", tags=["solo", "oc"], score=500, path="images/0.png", id=1)
    entry("0/low.json", "abs_min_score", tags=["solo"], score=3, path="images/1.png")
    entry("1/bonus.json", "min_score", tags=["monochrome"], score=120, path="images/2.png")
    entry("1/black.json", "blacklist_tags", tags=["animated"], score=900, path="images/3.png")
    entry("2/broken.json", "bad_metadata", raw="{ not json")
    entry("2/gone.json", "missing_image", tags=["x"], score=900, path="images/none.png")
    entry("2/up.json", "outside_root", tags=["x"], score=900, path="../outside/secret.png")
    (meta / "metadata/readme.txt").write_text("about the dataset")
    expected[(m, "metadata/readme.txt")] = "unsupported_extension"
    nth = meta / "every_other"
    for i in range(2):
        (nth / f"{i}.json").parent.mkdir(parents=True, exist_ok=True)
        (nth / f"{i}.json").write_text(json.dumps({"tags": ["t"], "score": 900,
                                                   "path": "images/0.png"}))
    expected[(m, "every_other/0.json")] = "duplicate"  # same image as metadata/0/keep.json
    expected[(m, "every_other/1.json")] = "consider_every_nth"

    # a Hugging Face imagefolder
    save(hf / "x.png", picture(200))
    save(hf / "nested" / "y.jpg", picture(201), quality=90)
    rows = [{"file_name": "x.png", "text": "an x"}, {"file_name": "nested/y.jpg", "text": "a y"},
            {"file_name": "lost.png", "text": "lost"}]
    (hf / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    expected.update({(h, "x.png"): "kept", (h, "nested/y.jpg"): "kept",
                     (h, "lost.png"): "missing_image"})

    # an edit dataset: targets with reference images in a control folder
    edits = root / "edits"
    e = str(edits)
    save(edits / "kept.png", picture(300), caption="make it blue")
    save(edits / "control" / "kept.png", picture(301))
    save(edits / "alone.png", picture(302), caption="no reference")
    save(edits / "broken.png", picture(303), caption="bad reference")
    (edits / "control" / "broken.png").write_bytes(b"\x89PNG truncated")
    expected.update({(e, "kept.png"): "kept", (e, "alone.png"): "missing_reference",
                     (e, "broken.png"): "bad_reference"})

    # clips: a clip file and a folder of frames kept, every way a clip fails
    clips = root / "clips"
    c = str(clips)
    make_clip(clips / "wave.mp4", frames=30)
    (clips / "wave.txt").write_text("a bar moving", encoding="utf-8")
    (clips / "spin").mkdir()
    for i in range(25):  # 1 s at the source's frames_fps 24: 9 frames at 8 fps
        Image.fromarray(frame(i, (48, 48))).save(clips / "spin" / f"{i:02d}.png")
    (clips / "spin.txt").write_text("frames of a bar", encoding="utf-8")
    audio_only(clips / "voice.mp4")
    hours_long_header(clips / "ten_hours.mov")
    zero_frames(clips / "no_frames.mp4")
    truncated(clips / "cut.mp4")
    make_clip(clips / "huge.mp4", frames=9, size=(3840, 2160), fps=8)  # 1 s: 9 samples, each 4K
    make_clip(clips / "blink.webm", frames=6)
    os.mkfifo(clips / "pipe.mp4")
    expected.update({(c, "wave.mp4"): "kept", (c, "spin"): "kept", (c, "voice.mp4"): "not_a_video",
                     (c, "ten_hours.mov"): "too_long", (c, "no_frames.mp4"): "too_short",
                     (c, "cut.mp4"): "corrupt", (c, "huge.mp4"): "decode_limit", (c, "blink.webm"): "too_short",
                     (c, "pipe.mp4"): "not_regular_file"})

    rules = {"abs_min_score": 50, "min_score": 200, "tag_bonus_scores": {"monochrome": -75},
             "blacklist_tags": ["animated"], "score_tags": [400]}
    sources = [
        {"type": "folder", "path": f},
        {"type": "metadata_json", "path": m, **rules},
        {"type": "metadata_json", "path": m, "metadata_dir": "every_other", "consider_every_nth": 2},
        {"type": "imagefolder", "path": h},
        {"type": "folder", "path": e, "control_dir": "control"},
        {"type": "clips", "path": c},
    ]
    return sources, expected
