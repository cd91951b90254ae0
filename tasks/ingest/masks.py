"""Subject masks at ingest: read from a file or the image's alpha channel, checked, shaped like the image.

A mask says where the loss counts (tasks/train, `masked_loss`): 255 = the subject (full weight),
0 = outside. It comes, for a folder source, from a same-named file in the source's `mask_dir`
(kohya's conditioning folder, ai-toolkit's `mask_path`) or from `<stem>-masklabel.png` beside
the image (OneTrainer); for any source, with `ingest.alpha_mask`, from the image's own alpha
channel (kohya's and ai-toolkit's `alpha_mask`). It is checked like an image (readable, within
`max_pixels` from its header before any pixel is decoded, of its image's size, not all black:
`bad_mask` otherwise, naming the mask file; a decompression bomb too), made upright with the
same EXIF rule, and then goes through exactly the resize and crop its image goes through
(tasks/ingest/work.py), so a processed mask lies pixel for pixel on its processed image.
"""
from __future__ import annotations

import io

from PIL import Image, ImageOps

from tasks.common.images import apply_exif_orientation
from tasks.ingest.checks import Reject, open_header, pixel_limit

#: Where a row's mask came from (metadata.jsonl `mask_source`; "generated": made by a model).
MASK_SOURCES = ("file", "masklabel", "alpha", "generated")
MASKLABEL_SUFFIX = "-masklabel.png"  # OneTrainer's mask beside its image: <stem>-masklabel.png
_ALPHA_MODES = ("RGBA", "LA", "PA", "RGBa", "La")


def has_alpha(image: Image.Image) -> bool:
    return image.mode in _ALPHA_MODES or (image.mode == "P" and "transparency" in image.info)


def alpha_of(upright: Image.Image) -> Image.Image:
    """The alpha channel of an image that has one, as an "L" mask."""
    rgba = upright if upright.mode == "RGBA" else upright.convert("RGBA")
    return rgba.getchannel("A")


def read_mask(data: bytes, name: str, source_size: tuple[int, int], decoded_size: tuple[int, int],
              max_pixels: int) -> Image.Image:
    """Decode a mask file into an upright "L" image of `decoded_size` (the decoded image's size).

    `source_size` is the image's upright size as stored in its file: the mask must have exactly it.
    As for an image, the header is checked before any pixel is decoded: a mask over `max_pixels`
    (a decompression bomb included) or of another size than its image is `bad_mask`, never decoded.
    (A JPEG may be decoded at reduced scale; the mask is then reduced to the same pixels.)
    """
    with pixel_limit(max_pixels):
        try:
            im = open_header(data, max_pixels)
        except Reject as err:
            what = "too large" if err.reason == "too_large" else "not a readable image"
            raise Reject("bad_mask", f"mask {name} is {what} ({err.detail})") from None
        with im:
            if im.size not in (tuple(source_size), tuple(source_size)[::-1]):  # upright or turned by EXIF
                raise _wrong_size(name, im.size, source_size)
            try:
                im.load()
                mask = apply_exif_orientation(im)
                mask = mask.convert("L") if mask.mode != "L" else mask.copy()
            except Exception as err:  # PIL raises many types on damaged data
                raise Reject("bad_mask", f"mask {name} is not a readable image ({type(err).__name__}: {err})"
                             ) from None
    if mask.size != tuple(source_size):
        raise _wrong_size(name, mask.size, source_size)
    if mask.size != tuple(decoded_size):
        mask = mask.resize(decoded_size, Image.Resampling.BOX)
    return mask


def _wrong_size(name: str, size: tuple[int, int], source_size: tuple[int, int]) -> Reject:
    (mw, mh), (iw, ih) = size, source_size
    return Reject("bad_mask", f"mask {name} is {mw}x{mh}, its image {iw}x{ih}: a mask must have its image's size")


def finish(mask: Image.Image, name: str, invert: bool, min_value: float) -> Image.Image:
    """Invert (ai-toolkit's `invert_mask`), refuse an empty mask, raise the floor (`mask_min_value`)."""
    if invert:
        mask = ImageOps.invert(mask)
    if mask.getbbox() is None:
        raise Reject("bad_mask", f"mask {name} is all black (0 everywhere): no pixel of the image would "
                                 "train; fix the mask or remove it")
    floor = round(min_value * 255)
    return mask.point(lambda v: max(v, floor)) if floor else mask


def encode_png(mask: Image.Image, compress_level: int) -> bytes:
    buf = io.BytesIO()
    mask.save(buf, format="PNG", compress_level=compress_level)
    return buf.getvalue()
