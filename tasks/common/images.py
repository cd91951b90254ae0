"""Image helpers shared by the stages (ingest, class_images, evaluate).

Kept dependency-light (PIL only) so any stage can import them without pulling torch.
"""
from __future__ import annotations

import math

from PIL import Image, ImageOps

#: Background used when flattening transparency and filling empty grid cells.
WHITE = (255, 255, 255)


def make_grid(images: list[Image.Image], cols: int | None = None) -> Image.Image:
    """Tile `images` into one RGB picture, row by row, `cols` per row (default: a near-square grid).

    Cells are as large as the largest image; smaller images are centred in their cell on white,
    so images of mixed sizes still make a readable grid (nothing is rescaled).
    """
    if not images:
        raise ValueError("make_grid needs at least one image")
    n = len(images)
    cols = max(1, min(cols or math.ceil(math.sqrt(n)), n))
    rows = math.ceil(n / cols)
    cell_w = max(im.width for im in images)
    cell_h = max(im.height for im in images)
    grid = Image.new("RGB", (cols * cell_w, rows * cell_h), WHITE)
    for i, im in enumerate(images):
        r, c = divmod(i, cols)
        x = c * cell_w + (cell_w - im.width) // 2
        y = r * cell_h + (cell_h - im.height) // 2
        grid.paste(to_rgb(im), (x, y))
    return grid


def filmstrip(frames: list[Image.Image]) -> Image.Image:
    """A clip as one image: its frames side by side, in order (tasks/common/scoring.py's split_frames cuts it back)."""
    return make_grid(frames, cols=len(frames))


def to_rgb(image: Image.Image, background: tuple[int, int, int] = WHITE) -> Image.Image:
    """Convert any PIL mode to 8-bit RGB; transparency is composited onto `background`.

    Handles the modes that trip a plain `.convert("RGB")`: 16/32-bit greyscale (I;16, I) would
    clip to white, float (F) likewise, and palette or LA images may carry transparency.
    """
    if image.mode == "RGB":
        return image
    if image.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        image = _scale_to_l(image)
    if image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = image.convert("RGBA")
        flat = Image.new("RGB", rgba.size, background)
        flat.paste(rgba, mask=rgba.getchannel("A"))
        return flat
    return image.convert("RGB")


def _scale_to_l(image: Image.Image) -> Image.Image:
    """Map a high-bit-depth greyscale image onto 0..255 by its range, instead of clipping.

    16-bit files (PIL opens them as I;16 or I) span 0..65535; 32-bit and float data are scaled
    by their own extrema.
    """
    import numpy as np

    arr = np.asarray(image).astype(np.float64)
    if image.mode.startswith("I;16"):
        top = 65535.0
    else:
        lo, hi = float(arr.min()), float(arr.max())
        if image.mode == "I" and lo >= 0 and hi <= 65535:
            top = 255.0 if hi <= 255 else 65535.0
        else:
            arr = arr - lo
            top = (hi - lo) or 1.0
    return Image.fromarray(np.clip(arr * (255.0 / top) + 0.5, 0, 255).astype(np.uint8), "L")


def resize_short_side(image: Image.Image, resolution: int) -> Image.Image:
    """Resize (Lanczos) so the short side is `resolution`, keeping the aspect ratio.

    Used alone for aspect-ratio bucketing at a fixed scale, and before a square crop.
    """
    w, h = image.size
    scale = resolution / min(w, h)
    new = (max(resolution, round(w * scale)), max(resolution, round(h * scale)))
    return image.resize(new, Image.Resampling.LANCZOS) if new != (w, h) else image


def resize_and_crop(image: Image.Image, resolution: int, center: bool = True) -> Image.Image:
    """Resize so the short side is `resolution` (Lanczos), then crop a square (centre or top-left).

    This is the preprocessing the diffusers DreamBooth example applies at training time; doing it
    once at ingest makes the processed set the exact training input and keeps training fast.
    """
    resized = resize_short_side(image, resolution)
    if center:
        left = (resized.width - resolution) // 2
        top = (resized.height - resolution) // 2
    else:
        left = top = 0
    return resized.crop((left, top, left + resolution, top + resolution))


def apply_exif_orientation(image: Image.Image) -> Image.Image:
    """Rotate/flip pixels as the EXIF Orientation tag says (cameras store portraits sideways).

    An upright image is returned as is: PIL would return a full copy (about 1 ms at 512 px).
    """
    if image.getexif().get(0x0112, 1) == 1:
        return image
    return ImageOps.exif_transpose(image) or image


def cover_size(original: tuple[int, int], target: tuple[int, int]) -> tuple[int, int]:
    """(width, height) an image of `original` (h, w) is resized to, to cover `target` (h, w)."""
    (h, w), (th, tw) = original, target
    scale = max(th / h, tw / w)
    return (max(tw, round(w * scale)), max(th, round(h * scale)))


def follow_geometry(image: Image.Image, original: tuple[int, int], target: tuple[int, int],
                    crop: tuple[int, int], flip: bool) -> Image.Image:
    """`image` through the resize, crop and flip another image of size `original` (h, w) got to
    `target` (h, w) at `crop` (top, left): stretched onto `original` first when its size differs."""
    (th, tw), (top, left) = target, crop
    if image.size != (original[1], original[0]):
        image = image.resize((original[1], original[0]), Image.Resampling.BILINEAR)
    size = cover_size(original, target)
    if size != image.size:
        image = image.resize(size, Image.Resampling.BILINEAR)
    image = image.crop((left, top, left + tw, top + th))
    return image.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if flip else image
