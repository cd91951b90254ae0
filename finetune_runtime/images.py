"""An edit's input images in a request: the `image` param, decoded and checked before any work.

A model whose family edits (FLUX.2 [klein]: reference images beside the prompt) records how many
input images it takes (its call convention's `input_images`); a request sends them as the param
`image`, a list of base64-encoded PNG, JPEG or WebP files (a `data:` URL prefix is accepted), and
every prompt of the request edits them. Each is refused with HTTP 400 naming `image[i]` when it is
not base64, not one of those formats, too long, too small or too large (`decoded` reads a file's
header before its pixels, so a decompression bomb is refused unread). The edit's size, when the
request asks for none, is size.py's; the images' own pixels, at the size the pipeline encodes them,
count towards the request's cost (limits.Budget).
"""
from __future__ import annotations

import base64
import binascii
import io
import math
from typing import Any

from finetune_runtime.size import encoded_size

IMAGE_PARAM = "image"
MAX_IMAGE_CHARS = 16 * 2**20  # base64 text of one input image: a 12 MB file
MIN_SIDE, MAX_SIDE = 64, 4096  # each side of an input image, in pixels
FORMATS = ("PNG", "JPEG", "WEBP")


def _bad(message: str) -> Exception:
    from mlflow.exceptions import MlflowException

    return MlflowException.invalid_parameter_value(message)


def decoded(i: int, text: Any) -> Any:
    """Input image i as an upright RGB PIL image, or a bad_request naming `image[i]`."""
    from PIL import Image, ImageOps, UnidentifiedImageError

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
    try:
        image.load()
    except (OSError, ValueError, Image.DecompressionBombError) as err:
        raise _bad(f"{field}: the file is damaged ({err})") from None
    return ImageOps.exif_transpose(image).convert("RGB")


def input_images(values: Any, allowed: int, needed: int = 0) -> list[Any]:
    """The request's input images (`image` param), decoded; [] without; a bad_request naming the field
    (fewer than `needed`: a model that edits only)."""
    if values is None:
        values = []
    if isinstance(values, str) or not hasattr(values, "__len__"):
        raise _bad(f"{IMAGE_PARAM}: expected a list of base64-encoded images, got {type(values).__name__}")
    values = list(values)
    if values and allowed <= 0:
        raise _bad(f"{IMAGE_PARAM}: this model takes no input image (it generates from a prompt only); "
                   "send the prompts alone")
    if len(values) > allowed:
        raise _bad(f"{IMAGE_PARAM}: {len(values)} input images; this model takes at most {allowed}")
    if len(values) < needed:
        raise _bad(f"{IMAGE_PARAM}: this model edits an input image and cannot make one from a prompt alone; "
                   f"send {needed} or more (up to {allowed}) base64-encoded images in `{IMAGE_PARAM}`")
    return [decoded(i, v) for i, v in enumerate(values)]


def encoded_pixels(images: list[Any], max_pixels: int | None, exact_pixels: int | None = None) -> int:
    """The input images' pixels as the pipeline encodes them, each scaled to at most `max_pixels`, or to
    `exact_pixels` whatever its size (Qwen-Image-Edit's megapixel): their tokens join every step."""
    if exact_pixels:
        return exact_pixels * len(images)
    return sum(math.prod(encoded_size(im.size, max_pixels)) for im in images)
