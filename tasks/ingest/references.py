"""Reference (condition) images for edit training: found by the peers' conventions, checked, shaped.

An edit dataset is (reference image(s), target image, instruction) triples: the target is the
training image, the caption its instruction, the references what the model sees as input. They
come, for a folder source, from a same-named file in the source's `control_dir` (kohya's
`conditioning_data_dir`, musubi-tuner's `control_directory`): `control/a.png` for `a.jpg`, and
several numbered as musubi-tuner numbers them, `a_0.png`, `a_1.png`, ... (any digits, any image
extension; `a.png` first, then by number). A control file whose stem is itself a target's stem
belongs to that target, never as a numbered reference of another. For an imagefolder or a hub
dataset they come from a column (diffusers' `--cond_image_column`).

Each reference is checked like an image (a regular file inside the root, readable, within
`max_pixels` from its header, `min_side`, `max_aspect_ratio`): a failure rejects its target as
`bad_reference`, the detail naming the reference file. It is made upright, 8-bit RGB (transparency
composited onto `background`), then resized to cover its processed target's size and centre-cropped
to it, as diffusers' FLUX.2 [klein] img2img example gives the condition image the target's geometry;
random crops, flips and buckets at training time then move target and references together.
"""
from __future__ import annotations

import io
import os
import re
from pathlib import Path

from PIL import Image, ImageOps

from tasks.common.images import apply_exif_orientation, to_rgb
from tasks.ingest.checks import Limits, Reject, decode, read_bytes

REFERENCES = "references"  # processed references: <out>/references/<stem>.png, or <stem>_<i>.png for several
_NUMBERED = re.compile(r"^(?P<stem>.+)_(?P<index>\d+)$")
_IMAGE_EXTENSIONS = frozenset({".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff"})


def listing(folder: Path, image_stems: set[str]) -> dict[str, list[str]]:
    """{target stem: its reference paths, in order} for one folder of the control tree (empty when absent)."""
    try:
        names = sorted(n for n in os.listdir(folder) if Path(n).suffix.lower() in _IMAGE_EXTENSIONS)
    except OSError:
        return {}
    exact: dict[str, str] = {}
    numbered: dict[str, list[tuple[int, str]]] = {}
    for name in names:
        stem = Path(name).stem
        match = _NUMBERED.match(stem)
        if stem in image_stems:
            exact.setdefault(stem, str(folder / name))
        elif match and match["stem"] in image_stems:
            numbered.setdefault(match["stem"], []).append((int(match["index"]), str(folder / name)))
    found = {stem: [path] for stem, path in exact.items()}
    for stem, items in numbered.items():
        found.setdefault(stem, []).extend(path for _, path in sorted(items))
    return found


def read_reference_file(root: Path, path: Path) -> bytes:
    """A reference file's bytes, read through the root confinement; any failure is `bad_reference`."""
    try:
        return read_bytes(root, path)
    except Reject as err:
        if err.reason == "outside_root":
            raise
        raise Reject("bad_reference", f"reference {path.name}: {err}") from None


def shape_reference(data: bytes, name: str, size: tuple[int, int], limits: Limits,
                    background: tuple[int, int, int]) -> Image.Image:
    """One reference, checked like an image, upright RGB, covering `size` (the processed target's) and
    centre-cropped to it. Any failure is `bad_reference` naming the reference."""
    try:
        image, _ = decode(data, limits, min(size))
        upright = apply_exif_orientation(image)
        rgb = to_rgb(upright, background)
    except Reject as err:
        raise Reject("bad_reference", f"reference {name}: {err}") from None
    except Exception as err:  # PIL raises many types on damaged data
        raise Reject("bad_reference", f"reference {name}: corrupt: {type(err).__name__}: {err}") from None
    return ImageOps.fit(rgb, size, Image.Resampling.LANCZOS, centering=(0.5, 0.5))


def encode_references(refs: list[tuple[bytes, str]], size: tuple[int, int], limits: Limits,
                      background: tuple[int, int, int], compress_level: int) -> list[bytes]:
    """Each reference (bytes, name) shaped to `size` and encoded as PNG (lossless: it is an input)."""
    encoded = []
    for data, name in refs:
        buf = io.BytesIO()
        shape_reference(data, name, size, limits, background).save(buf, format="PNG",
                                                                    compress_level=compress_level)
        encoded.append(buf.getvalue())
    return encoded


def output_names(stem: str, count: int) -> list[str]:
    """Where a target's references go in the processed set (musubi-tuner's own layout)."""
    if count == 1:
        return [f"{REFERENCES}/{stem}.png"]
    return [f"{REFERENCES}/{stem}_{i}.png" for i in range(count)]
