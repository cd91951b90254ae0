"""Image validation: every way a file can fail becomes a `Reject` with a stable reason name.

Reasons are identifiers (they key `rejected_by_reason` in reports/ingest.json and DVC metrics
diffs), so they are listed once here in `REASONS` and never invented ad hoc.
"""
from __future__ import annotations

import io
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from PIL import Image, UnidentifiedImageError

from tasks.common.images import apply_exif_orientation, resize_and_crop, to_rgb

#: Every rejection reason, in the order reports list them.
REASONS: tuple[str, ...] = (
    "symlink_outside_root",  # resolves outside the source folder: never read
    "broken_symlink",  # points at nothing
    "unreadable",  # permission denied or another OS error while reading
    "empty_file",  # zero bytes
    "unsupported_extension",  # not an image extension (and not a caption beside an image)
    "orphan_caption",  # a caption file with no image beside it
    "not_an_image",  # image extension, but PIL recognises no image format
    "corrupt",  # recognised, but decoding fails (truncated, bad data)
    "too_large",  # more pixels than ingest.max_pixels (decompression bombs included)
    "too_small",  # short side below ingest.min_side
    "aspect_ratio",  # long side / short side above ingest.max_aspect_ratio
    "duplicate",  # same bytes as an image already kept
)


class Reject(Exception):
    """A file is not kept; `reason` is one of REASONS, `detail` says what exactly was wrong."""

    def __init__(self, reason: str, detail: str = "", **extra: str) -> None:
        if reason not in REASONS:
            raise ValueError(f"unknown rejection reason {reason!r}")
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail
        self.extra = extra


@dataclass(frozen=True)
class Limits:
    """What an acceptable source image looks like (from the `ingest` params)."""

    min_side: int
    max_pixels: int
    max_aspect_ratio: float


def inside_root(root: Path, path: Path) -> Path:
    """Resolve `path` (symlinks included) and require it to stay under `root` (already resolved).

    Raises Reject before anything is read, so a link to /etc/passwd or ../secrets is never opened.
    """
    target = path.resolve()
    if target != root and root not in target.parents:
        raise Reject("symlink_outside_root", f"resolves to {target}, outside {root}")
    if not target.exists():
        raise Reject("broken_symlink", f"points to missing {target}")
    return target


def read_bytes(root: Path, path: Path) -> bytes:
    """Read a file that must lie inside `root`; empty and unreadable files are rejected."""
    target = inside_root(root, path)
    try:
        data = target.read_bytes()
    except OSError as err:
        raise Reject("unreadable", f"{type(err).__name__}: {err.strerror or err}") from None
    if not data:
        raise Reject("empty_file", "0 bytes")
    return data


@contextmanager
def _pixel_limit(max_pixels: int) -> Iterator[None]:
    """Make PIL refuse images over `max_pixels` at open time (header only), then restore its limit.

    PIL warns above MAX_IMAGE_PIXELS and raises above twice that; both are turned into errors.
    """
    saved = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = max_pixels
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            yield
    finally:
        Image.MAX_IMAGE_PIXELS = saved


def decode(data: bytes, limits: Limits) -> Image.Image:
    """Open and fully decode `data`, checking size limits from the header before decoding pixels."""
    with _pixel_limit(limits.max_pixels):
        try:
            image = Image.open(io.BytesIO(data))
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
            raise Reject("too_large", str(err).split(".")[0]) from None
        except UnidentifiedImageError:
            raise Reject("not_an_image", "no image format recognised") from None
        except Exception as err:  # PIL raises many types on malformed headers
            raise Reject("corrupt", f"{type(err).__name__}: {err}") from None
        w, h = image.size
        if w * h > limits.max_pixels:
            raise Reject("too_large", f"{w}x{h} = {w * h} pixels > max_pixels {limits.max_pixels}")
        if min(w, h) < limits.min_side:
            raise Reject("too_small", f"{w}x{h}: short side < min_side {limits.min_side}")
        if max(w, h) / min(w, h) > limits.max_aspect_ratio:
            ratio = max(w, h) / min(w, h)
            limit = limits.max_aspect_ratio
            raise Reject("aspect_ratio", f"{w}x{h}: ratio {ratio:.2f} > max_aspect_ratio {limit}")
        try:
            image.load()  # truncated or damaged data fails here, not at open
        except Exception as err:
            raise Reject("corrupt", f"{type(err).__name__}: {err}") from None
    return image


def normalise(image: Image.Image, resolution: int, center_crop: bool) -> Image.Image:
    """Upright (EXIF), 8-bit RGB (transparency on white), short side `resolution`, square crop."""
    upright = apply_exif_orientation(image)
    return resize_and_crop(to_rgb(upright), resolution, center=center_crop)

