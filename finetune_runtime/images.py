"""An edit's input images in a request: the `image` param, checked before any work, decoded in the model's turn.

A model whose family edits (FLUX.2 [klein]: reference images beside the prompt) records how many
input images it takes (its call convention's `input_images`); a request sends them in the param
`image`, one string: a base64-encoded PNG, JPEG or WebP file (a `data:` URL prefix is accepted), or
a JSON list of such files (`json.dumps([b64, b64])`) for more than one; every prompt of the request
edits them. One string, not a list param: MLflow turns a list param into a fixed-width numpy array
(count x longest string x 4 bytes) before the model's own checks run, so a 4 MB request of one long
string and 300 short ones asked it for gigabytes; a string param is copied once (docs/registry.md, "Limits of
a served model"). Each image is refused with HTTP 400 naming `image[i]` when it is not base64, not
one of those formats, too long, too small or too large (`opened` reads a file's header before its
pixels, so a decompression bomb is refused unread). `opened` checks before the queue; `decoded`,
the pixels, runs once the request has its turn (finetune_runtime/model.py). The edit's size, when
the request asks for none, is size.py's; the images' own pixels, at the size the pipeline encodes
them, count towards the request's cost (limits.Budget).
"""
from __future__ import annotations

import base64
import binascii
import io
import json
import math
import struct
from typing import Any

from finetune_runtime.size import encoded_size

IMAGE_PARAM = "image"
MAX_IMAGE_CHARS = 16 * 2**20  # base64 text of one input image: a 12 MB file
MIN_SIDE, MAX_SIDE = 64, 4096  # each side of an input image, in pixels
FORMATS = ("PNG", "JPEG", "WEBP")


def _bad(message: str) -> Exception:
    from mlflow.exceptions import MlflowException

    return MlflowException.invalid_parameter_value(message)


#: EXIF Orientation -> the PIL Image.Transpose value that makes the image upright (ImageOps.exif_transpose's
#: table: FLIP_LEFT_RIGHT 0, FLIP_TOP_BOTTOM 1, ROTATE_90 2, ROTATE_180 3, ROTATE_270 4, TRANSPOSE 5, TRANSVERSE 6)
TURNS = {2: 0, 3: 3, 4: 1, 5: 5, 6: 4, 7: 6, 8: 2}


class Opened:
    """Input image i, its header read and checked, its pixels not yet decoded: `size` is upright (EXIF
    orientation applied), as `decoded` will return it."""

    def __init__(self, i: int, image: Any) -> None:
        from PIL import Image

        self.i, self.image = i, image
        # EXIF Orientation from what the header gave (image.getexif() would decode a PNG's pixels to
        # find a late eXIf chunk): 5-8 turn the image a quarter
        exif = image.info.get("exif")
        self.orientation = 1
        if exif:
            try:
                tags = Image.Exif()
                tags.load(exif)
                self.orientation = tags.get(0x0112, 1)
            except Exception:  # a damaged EXIF block: the image as stored
                self.orientation = 1
        width, height = image.size
        self.size = (height, width) if self.orientation in (5, 6, 7, 8) else (width, height)


def opened(i: int, text: Any) -> Opened:
    """Input image i with its header checked (format, each side), its pixels unread; a bad_request naming
    `image[i]` otherwise."""
    from PIL import Image, UnidentifiedImageError

    field = f"{IMAGE_PARAM}[{i}]"
    if not isinstance(text, str) or not text:
        raise _bad(f"{field}: expected a base64-encoded PNG, JPEG or WebP file, got {type(text).__name__}")
    if len(text) > MAX_IMAGE_CHARS:
        raise _bad(f"{field}: {len(text)} base64 characters; allowed: at most {MAX_IMAGE_CHARS} (a 12 MB file)")
    if text.startswith("data:") and "," in text:
        text = text.split(",", 1)[1]
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as err:
        raise _bad(f"{field}: not base64 ({err}); send the file's bytes base64-encoded") from None
    try:
        image = Image.open(io.BytesIO(data))
    except (UnidentifiedImageError, OSError):  # PIL's message names only its BytesIO object
        raise _bad(f"{field}: not an image (a PNG, JPEG or WebP file, base64-encoded)") from None
    if image.format not in FORMATS:
        raise _bad(f"{field}: a {image.format} file; allowed: {', '.join(FORMATS)}")
    width, height = image.size
    if not (MIN_SIDE <= width <= MAX_SIDE and MIN_SIDE <= height <= MAX_SIDE):
        raise _bad(f"{field}: {width}x{height} px; allowed: each side from {MIN_SIDE} to {MAX_SIDE} px")
    return Opened(i, image)


def decoded(images: list[Opened]) -> list[Any]:
    """The opened input images' pixels, each an upright RGB PIL image; a bad_request naming `image[i]`
    when a file's pixels are damaged."""
    from PIL import Image

    out = []
    for item in images:
        try:
            item.image.load()
        except (OSError, ValueError, EOFError, struct.error, Image.DecompressionBombError) as err:
            raise _bad(f"{IMAGE_PARAM}[{item.i}]: the file is damaged ({err})") from None
        turn = TURNS.get(item.orientation)
        out.append((item.image.transpose(turn) if turn is not None else item.image).convert("RGB"))
    return out


def image_texts(value: Any, allowed: int) -> list[str]:
    """The base64 texts the `image` param carries: one file, or a JSON list of them; a bad_request
    naming the field otherwise. Longer than `allowed` files could be: refused before JSON parses it."""
    if value is None or value == "":
        return []
    if not isinstance(value, str):
        raise _bad(f"{IMAGE_PARAM}: expected one string, a base64-encoded image or a JSON list of them, got "
                   f"{type(value).__name__}; send json.dumps of the list")
    if not value.lstrip().startswith("["):
        return [value]
    if len(value) > max(allowed, 1) * (MAX_IMAGE_CHARS + 16):
        raise _bad(f"{IMAGE_PARAM}: {len(value)} characters; allowed: at most {max(allowed, 1)} images of "
                   f"{MAX_IMAGE_CHARS} base64 characters each")
    try:
        texts = json.loads(value)
    except ValueError as err:
        raise _bad(f"{IMAGE_PARAM}: starts with '[' but is not a JSON list ({err}); send one base64 image, or "
                   "json.dumps of a list of them") from None
    if not isinstance(texts, list):
        raise _bad(f"{IMAGE_PARAM}: expected a JSON list of base64-encoded images, got {type(texts).__name__}")
    return texts


def input_images(value: Any, allowed: int, needed: int = 0) -> list[Opened]:
    """The request's input images (`image` param), opened and checked, pixels unread (`decoded` reads
    them); [] without; a bad_request naming the field (fewer than `needed`: a model that edits only)."""
    values = image_texts(value, allowed)
    if values and allowed <= 0:
        raise _bad(f"{IMAGE_PARAM}: this model takes no input image (it generates from a prompt only); "
                   "send the prompts alone")
    if len(values) > allowed:
        raise _bad(f"{IMAGE_PARAM}: {len(values)} input images; this model takes at most {allowed}")
    if len(values) < needed:
        raise _bad(f"{IMAGE_PARAM}: this model edits an input image and cannot make one from a prompt alone; "
                   f"send {needed} or more (up to {allowed}) base64-encoded images in `{IMAGE_PARAM}`")
    return [opened(i, v) for i, v in enumerate(values)]


def encoded_pixels(images: list[Any], max_pixels: int | None, exact_pixels: int | None = None) -> int:
    """The input images' pixels as the pipeline encodes them, each scaled to at most `max_pixels`, or to
    `exact_pixels` whatever its size (Qwen-Image-Edit's megapixel): their tokens join every step."""
    if exact_pixels:
        return exact_pixels * len(images)
    return sum(math.prod(encoded_size(im.size, max_pixels)) for im in images)
