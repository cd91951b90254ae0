"""The per-image work, run in worker processes: read, hash, decode, normalise, encode, store.

A worker gets small `Task`s (a path, or bytes for hub rows) and returns small `Outcome`s; pixels
never travel between processes: the processed image goes straight into the `Store` (the cache),
and the main process later copies (or moves) the kept ones into the output folder. Everything
here is a pure function of the source bytes and `Settings`, which is what makes caching by
content hash sound.
"""
from __future__ import annotations

import hashlib
import io
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image

from tasks.common.images import apply_exif_orientation, resize_and_crop, resize_short_side, to_rgb
from tasks.ingest.cache import Store
from tasks.ingest.checks import CAPTION_MAX_BYTES, Limits, Reject, decode, read_bytes
from tasks.ingest.clips import run_clip
from tasks.ingest.masks import alpha_of, encode_png, finish, has_alpha, read_mask
from tasks.ingest.references import encode_references, read_reference_file
from tasks.ingest.video import ClipSpec

log = logging.getLogger(__name__)

PNG_COMPRESS_LEVEL = 1  # zlib level 1: files ~10 % larger than level 6, encoding ~3x faster


@dataclass(frozen=True)
class Settings:
    """What decides the processed pixels (all of it goes into the cache fingerprint)."""

    limits: Limits
    output_size: str  # square | short_side | source
    resolution: int
    center_crop: bool
    background: tuple[int, int, int]
    output_format: str  # png | jpeg
    jpeg_quality: int
    alpha_mask: bool = False  # the alpha channel is the mask (when there is no mask file)
    invert_mask: bool = False
    mask_min_value: float = 0.0
    clips: tuple[ClipSpec, str] | None = None  # (ingest.video's spec, the work folder): clips are not cached

    def pixel_params(self) -> dict[str, Any]:
        params = {k: v for k, v in self.__dict__.items() if k not in ("limits", "clips")}
        params.update(self.limits.__dict__)
        if self.output_size == "source":
            params.pop("resolution")
        if self.output_size != "square":
            params.pop("center_crop")
        if self.output_format != "jpeg":
            params.pop("jpeg_quality")
        if not self.invert_mask and not self.mask_min_value:
            params.pop("invert_mask"), params.pop("mask_min_value")  # unset: not part of the fingerprint
        if not self.alpha_mask:
            params.pop("alpha_mask")
        return params

    @property
    def ext(self) -> str:
        return ".jpg" if self.output_format == "jpeg" else ".png"


@dataclass(frozen=True)
class Task:
    """One input to read: a file confined to `root`, or bytes already in hand (hub rows)."""

    root: str | None = None
    path: str | None = None
    data: bytes | None = None
    caption_path: str | None = None  # sidecar caption, read through the same confinement
    mask_path: str | None = None  # the image's mask file (tasks/ingest/masks.py), same confinement
    mask_source: str | None = None  # file | masklabel
    references: tuple[str, ...] = ()  # its reference images' files (tasks/ingest/references.py), same confinement
    reference_data: tuple[bytes, ...] = ()  # its reference images' bytes already in hand (hub rows)
    clip: bool = False  # a clip (tasks/ingest/clips.py): `path` is a video file, or a folder of `frames`
    frames: tuple[str, ...] = ()  # a folder clip's frame files, in order
    frames_fps: float = 0.0  # the rate they were shot at


@dataclass
class Outcome:
    """What a worker found: the content hash, the stored facts or the rejection, the caption."""

    sha: str | None = None
    reject: Reject | None = None
    entry: dict[str, Any] = field(default_factory=dict)
    caption: str | None = None
    cached: bool = False
    key: str | None = None  # the store's key: `sha`, or with a mask file a hash of both files


_worker: tuple[Settings, Store] | None = None


def init_worker(settings: Settings, store: Store) -> None:
    """Pool initializer: each worker process keeps the settings and the store it writes to."""
    global _worker
    _worker = (settings, store)


def run_batch(tasks: list[Task]) -> list[Outcome]:
    """Pool entry point: a batch per call keeps inter-process messages few."""
    assert _worker is not None, "init_worker was not called in this process"
    settings, store = _worker
    return [run_task(task, settings, store) for task in tasks]


def run_task(task: Task, settings: Settings, store: Store) -> Outcome:
    """Read one input, then reuse its stored outcome by content hash or compute and store it."""
    if task.clip:
        return run_clip_task(task, settings)
    try:
        data = task.data if task.data is not None else read_bytes(Path(task.root), Path(task.path))
        caption = read_caption(Path(task.root), Path(task.caption_path)) if task.caption_path else None
        mask = read_mask_file(Path(task.root), Path(task.mask_path)) if task.mask_path else None
        refs = _read_references(task)
    except Reject as err:
        return Outcome(reject=err)
    if not data:
        return Outcome(reject=Reject("empty_file", "0 bytes"))
    sha = hashlib.sha256(data).hexdigest()
    key = sha  # a mask and references are part of the key: a changed one is never served from the cache
    if mask is not None:
        key = hashlib.sha256(f"{sha}|{task.mask_source}|{hashlib.sha256(mask).hexdigest()}".encode()).hexdigest()
    if refs:
        ref_hashes = "|".join(hashlib.sha256(ref).hexdigest() for ref, _ in refs)
        key = hashlib.sha256(f"{key}|references|{ref_hashes}".encode()).hexdigest()
    entry = store.get(key)
    cached = entry is not None
    if entry is None:
        named = (mask, Path(task.mask_path).name, task.mask_source) if mask is not None else None
        entry, encoded, encoded_mask = process(data, settings, named)
        encoded_refs = _process_references(entry, refs, settings)
        if encoded_refs is None:
            encoded = encoded_mask = None
        store.put(key, entry, encoded, encoded_mask, encoded_refs or ())
    reject = Reject(entry["reject"], entry["detail"]) if "reject" in entry else None
    return Outcome(sha=sha, reject=reject, entry=entry, caption=caption, cached=cached, key=key)


def run_clip_task(task: Task, settings: Settings) -> Outcome:
    """A clip: checked and sampled into the work folder (not cached: its samples are the output)."""
    assert settings.clips is not None, "a clips source without ingest.video settings"
    spec, work = settings.clips
    try:
        caption = read_caption(Path(task.root), Path(task.caption_path)) if task.caption_path else None
        sha, entry = run_clip(Path(task.root), Path(task.path), task.frames, task.frames_fps, spec, Path(work))
    except Reject as err:
        return Outcome(reject=err)
    return Outcome(sha=sha, entry={"kind": "clip", **entry}, caption=caption, key=sha)


def _read_references(task: Task) -> list[tuple[bytes, str]]:
    """(bytes, name) of each reference of a task: its files (root-confined) or its bytes in hand."""
    if task.references:
        return [(read_reference_file(Path(task.root), Path(p)), Path(p).name) for p in task.references]
    return [(data, f"#{i}") for i, data in enumerate(task.reference_data)]


def _process_references(entry: dict[str, Any], refs: list[tuple[bytes, str]], s: Settings) -> list[bytes] | None:
    """The encoded references of a kept image ([] without any); None when one rejects the image
    (`entry` then becomes that rejection)."""
    if not refs or "reject" in entry:
        return []
    try:
        encoded = encode_references(refs, (entry["width"], entry["height"]), s.limits, s.background,
                                    PNG_COMPRESS_LEVEL)
    except Reject as err:
        entry.clear()
        entry.update({"reject": err.reason, "detail": err.detail})
        return None
    entry["references"] = len(encoded)
    return encoded


def read_mask_file(root: Path, path: Path) -> bytes:
    """A mask file's bytes, read through the root confinement; any failure is the image's `bad_mask`."""
    try:
        return read_bytes(root, path)
    except Reject as err:
        if err.reason == "outside_root":
            raise
        raise Reject("bad_mask", f"mask {path.name}: {err}") from None


def read_caption(root: Path, path: Path) -> str | None:
    """A sidecar caption's text (whitespace collapsed), or None when empty.

    Read through the root-confined reader: a caption linking outside the root rejects the image,
    as does one that is no regular file (a FIFO, ...) or is over CAPTION_MAX_BYTES.
    """
    try:
        data = read_bytes(root, path, CAPTION_MAX_BYTES)
    except Reject as err:
        if err.reason == "empty_file":
            return None
        raise Reject(err.reason, f"caption {path.name}: {err.detail}") from None
    text = " ".join(data.decode("utf-8-sig", errors="replace").split())
    return text or None


def process(data: bytes, s: Settings, mask_file: tuple[bytes, str, str] | None = None
            ) -> tuple[dict[str, Any], bytes | None, bytes | None]:
    """Decode and check, make upright 8-bit RGB, hash perceptually, resize/crop, encode.

    `mask_file`: (bytes, file name, mask source) of the image's mask; without it and with
    `alpha_mask`, the alpha channel is the mask. The mask gets the image's geometry exactly.
    """
    short_side = None if s.output_size == "source" else s.resolution
    try:
        image, stored_size = decode(data, s.limits, short_side)
    except Reject as err:
        return {"reject": err.reason, "detail": err.detail}, None, None
    try:  # decoded, yet odd files (a broken EXIF block, exotic modes) can still fail here
        upright = apply_exif_orientation(image)
        source_w, source_h = stored_size[::-1] if _swaps_axes(image) else stored_size
        mask, mask_source = _mask(upright, (source_w, source_h), mask_file, s)
        rgb = to_rgb(upright, s.background)
        phash = perceptual_hash(rgb)
        out = shape(rgb, s)
        out_mask = shape(mask, s) if mask is not None else None
        if passes_through(image, stored_size, out, s):
            encoded = data
        else:
            buf = io.BytesIO()
            if s.output_format == "jpeg":
                out.save(buf, format="JPEG", quality=s.jpeg_quality, subsampling=0)
            else:
                out.save(buf, format="PNG", compress_level=PNG_COMPRESS_LEVEL)
            encoded = buf.getvalue()
        encoded_mask = encode_png(out_mask, PNG_COMPRESS_LEVEL) if out_mask is not None else None
    except Reject as err:
        return {"reject": err.reason, "detail": err.detail}, None, None
    except Exception as err:
        log.warning("processing failed after decoding: %s: %s", type(err).__name__, err)
        return {"reject": "corrupt", "detail": f"processing failed: {type(err).__name__}: {err}"}, None, None
    entry = {
        "ext": s.ext,
        "width": out.width,
        "height": out.height,
        "source_width": source_w,
        "source_height": source_h,
        "phash": f"{phash:016x}",
        **({"mask_source": mask_source} if mask_source else {}),
    }
    return entry, encoded, encoded_mask


def shape(image: Image.Image, s: Settings) -> Image.Image:
    """The output geometry (`output_size`): the same for an image and its mask."""
    if s.output_size == "square":
        return resize_and_crop(image, s.resolution, center=s.center_crop)
    if s.output_size == "short_side":
        return resize_short_side(image, s.resolution)
    return image


def _mask(upright: Image.Image, source_size: tuple[int, int], mask_file: tuple[bytes, str, str] | None,
          s: Settings) -> tuple[Image.Image | None, str | None]:
    """(the upright "L" mask at the decoded image's size, its source), or (None, None) without one."""
    if mask_file is not None:
        data, name, source = mask_file
        mask = read_mask(data, name, source_size, upright.size, s.limits.max_pixels)
    elif s.alpha_mask and has_alpha(upright):
        mask, name, source = alpha_of(upright), "(the alpha channel)", "alpha"
    else:
        return None, None
    return finish(mask, name, s.invert_mask, s.mask_min_value), source


#: File metadata that says nothing about the pixels: a file with only these may pass through.
_NEUTRAL_INFO = {"jfif", "jfif_version", "jfif_unit", "jfif_density", "dpi", "aspect",
                 "progressive", "progression"}


def passes_through(image: Image.Image, stored_size: tuple[int, int], out: Image.Image,
                   s: Settings) -> bool:
    """True when the source file already is the output: kept byte for byte, not re-encoded.

    That is: 8-bit RGB in the output format, at the output size, and carrying nothing the
    normal path would drop or apply (EXIF, with its orientation and camera/GPS data, ICC
    profiles, transparency, gamma, text chunks). Re-encoding it would only cost time and,
    for JPEG, a generation of compression loss.
    """
    wanted = "JPEG" if s.output_format == "jpeg" else "PNG"
    return (
        image.format == wanted
        and image.mode == "RGB"
        and out.size == image.size == stored_size
        and set(image.info) <= _NEUTRAL_INFO
    )


def _swaps_axes(image: Image.Image) -> bool:
    """EXIF orientations 5-8 turn the picture by 90 degrees (width and height swap)."""
    return image.getexif().get(0x0112, 1) in (5, 6, 7, 8)


def perceptual_hash(image: Image.Image) -> int:
    """64-bit DCT perceptual hash (imagehash.phash) as an int, computed on a reduced copy.

    phash itself shrinks to 32x32; reducing by an integer factor first (box filter) to 64 px
    or more makes it ~10x cheaper on large images and changes few, if any, bits.
    """
    import imagehash

    factor = max(1, min(image.size) // 64)
    small = image.reduce(factor) if factor > 1 else image
    return int(str(imagehash.phash(small)), 16)
