"""Image validation: every way an input can fail becomes a `Reject` with a stable reason name.

Reasons are identifiers (they key `rejected_by_reason` in reports/ingest.json and DVC metrics
diffs), so they are listed once here in `REASONS` and never invented ad hoc. The metadata rules
reject under the rule's own name (`abs_min_score`, `min_score`, `blacklist_tags`, ...).
"""
from __future__ import annotations

import io
import math
import os
import stat
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, UnidentifiedImageError

#: Every rejection reason, in the order in which an input is checked.
REASONS: tuple[str, ...] = (
    # the file itself (decided from its name or while reading it)
    "outside_root",  # a symlink or metadata path leading outside the source root: never read
    "broken_symlink",  # points at nothing
    "not_regular_file",  # a FIFO, device, socket or folder (or a link to one): never opened
    "unreadable",  # permission denied or another OS error while reading
    "empty_file",  # zero bytes
    "oversized_file",  # a caption or metadata file over its byte cap (CAPTION_MAX_BYTES, ...)
    "unsupported_extension",  # not an image extension (and not a caption or metadata file)
    "orphan_caption",  # a caption file with no image beside it
    "orphan_mask",  # a `<stem>-masklabel.png` with no image of that stem beside it
    "missing_image",  # metadata names an image that does not exist
    "missing_reference",  # an edit source (control_dir, cond_image_column) gives this target no reference image
    "bad_metadata",  # metadata that cannot be parsed or lacks a required key
    # the metadata rules of the training notes (seed 003), by their names there
    "consider_every_nth",  # not one of every nth metadata file
    "abs_min_score",  # score below abs_min_score
    "min_score",  # score plus tag_bonus_scores below min_score
    "blacklist_tags",  # carries a blacklisted tag
    # the pixels
    "not_an_image",  # image extension, but PIL recognises no image format
    "corrupt",  # recognised, but decoding fails (truncated, bad data)
    "too_large",  # more pixels than ingest.max_pixels (decompression bombs included)
    "too_small",  # short side below ingest.min_side
    "aspect_ratio",  # long side / short side above ingest.max_aspect_ratio
    "bad_mask",  # its mask is unreadable, of another size than the image, or all black (detail: the mask)
    "bad_reference",  # one of its reference images fails the image checks (detail: the reference and why)
    # clips (a `clips` source; `corrupt`, `too_large`, `too_small`, `aspect_ratio` apply to them too)
    "not_a_video",  # a clip file FFmpeg finds no video stream (or no decoder) in
    "too_long",  # over ingest.video.max_seconds, by its header or by its packets
    "too_short",  # fewer frames than the smallest of ingest.video.frames at its fps (zero frames included)
    "decode_limit",  # its checks and decoding passed ingest.video.decode_seconds or decode_memory_mb
    # the caption policy (ingest.captions)
    "empty_caption",  # no caption, and captions.empty is drop
    "long_caption",  # over captions.max_words, and captions.too_long is drop
    # duplicates (the first one kept is named in `duplicate_of`)
    "duplicate",  # the same bytes as a kept image
    "near_duplicate",  # perceptual hash within ingest.near_duplicate_distance of a kept image
)


#: Byte caps of the small text files read whole (the images are bounded by max_pixels instead).
#: A caption is a sentence or a tag list: a few hundred bytes; 64 KiB is far above any real one.
CAPTION_MAX_BYTES = 64 * 1024
#: One image's JSON (the metadata_json source): a tag list and a score, a few KiB at most.
METADATA_JSON_MAX_BYTES = 1024 * 1024
#: An imagefolder's metadata.jsonl / metadata.csv, held in memory whole (as `datasets` does):
#: 256 MiB is about a million rows with long captions.
METADATA_MAX_BYTES = 256 * 1024 * 1024


class Reject(Exception):
    """An input is not kept; `reason` is one of REASONS, `detail` says what exactly was wrong."""

    def __init__(self, reason: str, detail: str = "", **extra: object) -> None:
        if reason not in REASONS:
            raise ValueError(f"unknown rejection reason {reason!r}")
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail
        self.extra = extra

    def __reduce__(self):  # picklable across worker processes, extras included
        return (_rebuild_reject, (self.reason, self.detail, self.extra))


def _rebuild_reject(reason: str, detail: str, extra: dict) -> Reject:
    return Reject(reason, detail, **extra)


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
    try:
        target = path.resolve()
    except (OSError, RuntimeError) as err:  # a symlink loop (RuntimeError before Python 3.13)
        raise Reject("unreadable", f"cannot resolve: {err}") from None
    if target != root and root not in target.parents:
        how = "links" if path.is_symlink() else "resolves"
        raise Reject("outside_root", f"{how} to {target}, outside {root}")
    if not target.exists():
        if path.is_symlink():
            raise Reject("broken_symlink", f"points to missing {target}")
        raise Reject("missing_image", f"{target} does not exist")
    return target


def read_bytes(root: Path, path: Path, max_bytes: int | None = None) -> bytes:
    """Read a file that must lie inside `root`; see `read_regular` for what is rejected."""
    return read_regular(inside_root(root, path), max_bytes)


_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder"))


def read_regular(target: Path, max_bytes: int | None = None) -> bytes:
    """The bytes of `target` (links resolved), only if it is a regular file of at most `max_bytes`.

    `os.stat` decides before any open: a FIFO would block the reader for ever and a device may never
    end, so they are rejected (`not_regular_file`) unopened; a file over `max_bytes` is rejected
    (`oversized_file`) unread. The file is then opened non-blocking and checked again on its
    descriptor, and at most `max_bytes` + 1 bytes are read, so one swapped in meanwhile or still
    growing cannot block or overrun either. Empty and unreadable files are rejected too.
    """
    try:
        info = os.stat(target)
        _require_regular(info.st_mode, "never opened")
        _check_size(info.st_size, max_bytes)
        fd = os.open(target, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
        with os.fdopen(fd, "rb") as fh:
            _require_regular(os.fstat(fh.fileno()).st_mode, "not read")
            data = fh.read() if max_bytes is None else fh.read(max_bytes + 1)
    except OSError as err:
        raise Reject("unreadable", f"{type(err).__name__}: {err.strerror or err}") from None
    _check_size(len(data), max_bytes)
    if not data:
        raise Reject("empty_file", "0 bytes")
    return data


def open_regular(target: Path, max_bytes: int) -> int:
    """A read-only descriptor of `target` if it is a non-empty regular file of at most `max_bytes`.

    For files too large to hold whole (clips): the same checks as `read_regular` (`stat` before any
    open, so a FIFO named like a video is refused unopened; non-blocking open, checked again on the
    descriptor), and the caller reads it in chunks. The caller closes the descriptor.
    """
    try:
        info = os.stat(target)
        _require_regular(info.st_mode, "never opened")
        _check_size(info.st_size, max_bytes)
        if info.st_size == 0:
            raise Reject("empty_file", "0 bytes")
        fd = os.open(target, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except OSError as err:
        raise Reject("unreadable", f"{type(err).__name__}: {err.strerror or err}") from None
    try:
        _require_regular(os.fstat(fd).st_mode, "not read")
    except Reject:
        os.close(fd)
        raise
    return fd


def _require_regular(mode: int, what: str) -> None:
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _KINDS if test(mode)), "a special file")
        raise Reject("not_regular_file", f"{kind}, not a regular file: {what}; remove it or replace it with "
                                         "the file itself")


def _check_size(size: int, max_bytes: int | None) -> None:
    if max_bytes is not None and size > max_bytes:
        raise Reject("oversized_file", f"{_size(size)}, over the cap of {_size(max_bytes)} for this kind "
                                       "of file; shorten it (or split it)")


def _size(n: int) -> str:
    """`70,000 bytes` / `64 KiB` / `256 MiB`: bytes exactly, caps in the unit they are set in."""
    for unit, scale in (("MiB", 1024 ** 2), ("KiB", 1024)):
        if n >= scale and n % scale == 0:
            return f"{n // scale:,} {unit}"
    return f"{n:,} bytes"


@contextmanager
def pixel_limit(max_pixels: int) -> Iterator[None]:
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


def draft_size(size: tuple[int, int], short_side: int | None) -> tuple[int, int] | None:
    """The smallest size that still has `short_side` pixels on the short side (None: full size)."""
    if short_side is None or min(size) <= short_side:
        return None
    scale = short_side / min(size)
    return (math.ceil(size[0] * scale), math.ceil(size[1] * scale))


def open_header(data: bytes, max_pixels: int) -> Image.Image:
    """Open `data` reading its header only (no pixel is decoded): the image, its pixels still unread.

    Rejects `not_an_image`, `corrupt` (a malformed header) and `too_large` (more than `max_pixels`).
    Call it inside `pixel_limit(max_pixels)`, so that PIL refuses a decompression bomb at open.
    """
    try:
        image = Image.open(io.BytesIO(data))
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
        raise Reject("too_large", str(err).split(".")[0]) from None
    except UnidentifiedImageError:
        raise Reject("not_an_image", "no image format recognised") from None
    except Exception as err:  # PIL raises many types on malformed headers
        raise Reject("corrupt", f"{type(err).__name__}: {err}") from None
    w, h = image.size
    if w * h > max_pixels:
        raise Reject("too_large", f"{w}x{h} = {w * h} pixels > max_pixels {max_pixels}")
    return image


def decode(data: bytes, limits: Limits, short_side: int | None = None) -> tuple[Image.Image, tuple[int, int]]:
    """Open and fully decode `data`, checking size limits from the header before decoding pixels.

    When the output needs only `short_side` pixels, JPEGs are decoded at a reduced scale
    (libjpeg's DCT scaling, 1/2 to 1/8, never below what is needed): several times faster.
    Returns the image and its size as stored in the file (before any reduction).
    """
    with pixel_limit(limits.max_pixels):
        image = open_header(data, limits.max_pixels)
        w, h = size = image.size
        if min(w, h) < limits.min_side:
            raise Reject("too_small", f"{w}x{h}: short side < min_side {limits.min_side}")
        if max(w, h) / min(w, h) > limits.max_aspect_ratio:
            ratio = max(w, h) / min(w, h)
            limit = limits.max_aspect_ratio
            raise Reject("aspect_ratio", f"{w}x{h}: ratio {ratio:.2f} > max_aspect_ratio {limit}")
        target = draft_size(size, short_side)
        if target is not None and image.format == "JPEG":
            image.draft(None, target)
        try:
            image.load()  # truncated or damaged data fails here, not at open
        except Exception as err:
            raise Reject("corrupt", f"{type(err).__name__}: {err}") from None
    return image, size
