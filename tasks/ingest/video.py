"""One clip, checked then sampled: header, packets, then only the frames the samples need (PyAV).

Runs inside the confined child (tasks/ingest/clip_child.py), which bounds its time and memory; the
checks here bound the work itself, so that a well-formed but hostile file costs little:

1. the header (no packet read): a video stream FFmpeg can decode, its size (`max_pixels`,
   `min_side`, `max_aspect_ratio`) and the duration it states (`max_seconds`: a 10-hour header is
   refused here, before anything else is read);
2. the packets (demuxed, not decoded): how many frames there really are and the time they span;
   counting stops past `max_seconds`. Fewer packets than the header lists, or packets ending well
   before the duration it states, is a truncated file (`corrupt`); none is `too_short`;
3. the decode: from the start, only up to the last sample, each sample the frame nearest its time,
   resized into the clip's bucket at once (memory holds the samples at bucket size, not the clip).

The sampling and bucketing arithmetic is shared with folders of frames (tasks/ingest/clips.py).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from fractions import Fraction
from pathlib import Path
from typing import IO, Any

from PIL import Image

from tasks.ingest.checks import Reject

#: Packets counted at most per second of max_seconds (a stream claiming more frames per second is refused)
MAX_PACKET_RATE = 240
PNG_COMPRESS_LEVEL = 1  # as the images' (tasks/ingest/work.py)


@dataclass(frozen=True)
class ClipSpec:
    """What a kept clip must be and becomes (ingest.video, plus ingest's min_side and max_aspect_ratio)."""

    frames: tuple[int, ...]
    fps: float
    resolution: int
    bucket_step: int
    max_seconds: float
    max_pixels: int
    max_bytes: int
    min_side: int
    max_aspect_ratio: float
    decode_seconds: float
    decode_memory_mb: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ClipSpec:
        return cls(**{**data, "frames": tuple(data["frames"])})


def check_size(width: int, height: int, spec: ClipSpec) -> None:
    """A frame size's checks, from the header: max_pixels, min_side, max_aspect_ratio."""
    if width <= 0 or height <= 0:
        raise Reject("corrupt", f"the header states a {width}x{height} frame")
    if width * height > spec.max_pixels:
        raise Reject("too_large", f"{width}x{height} = {width * height} pixels per frame > "
                                  f"ingest.video.max_pixels {spec.max_pixels}")
    if min(width, height) < spec.min_side:
        raise Reject("too_small", f"{width}x{height}: short side < ingest.min_side {spec.min_side}")
    ratio = max(width, height) / min(width, height)
    if ratio > spec.max_aspect_ratio:
        raise Reject("aspect_ratio", f"{width}x{height}: ratio {ratio:.2f} > ingest.max_aspect_ratio "
                                     f"{spec.max_aspect_ratio}")


def bucket_size(width: int, height: int, spec: ClipSpec) -> tuple[int, int]:
    """The clip's aspect bucket: about `resolution`^2 pixels at its aspect, sides multiples of bucket_step."""
    aspect = width / height
    step = spec.bucket_step

    def side(length: float) -> int:
        return max(step, round(length / step) * step)

    return side(spec.resolution * math.sqrt(aspect)), side(spec.resolution / math.sqrt(aspect))


def frame_count(span: float, spec: ClipSpec) -> int:
    """The longest of `spec.frames` whose samples, 1/fps apart, fit in `span` seconds (first frame to last)."""
    fit = math.floor(span * spec.fps + 1e-6) + 1
    counts = [f for f in spec.frames if f <= fit]
    if not counts:
        need = (spec.frames[0] - 1) / spec.fps
        raise Reject("too_short", f"its frames span {span:.2f} s: the smallest frame count {spec.frames[0]} "
                                  f"at {spec.fps:g} fps needs {need:.2f} s (ingest.video.frames, fps)")
    return counts[-1]


def fit_to_bucket(image: Image.Image, size: tuple[int, int]) -> Image.Image:
    """Resize (Lanczos) to cover `size`, then crop its centre to exactly `size`."""
    w, h = image.size
    scale = max(size[0] / w, size[1] / h)
    covered = (max(size[0], round(w * scale)), max(size[1], round(h * scale)))
    if covered != (w, h):
        image = image.resize(covered, Image.Resampling.LANCZOS)
    left, top = (covered[0] - size[0]) // 2, (covered[1] - size[1]) // 2
    return image.crop((left, top, left + size[0], top + size[1]))


def write_frames(frames: list[Image.Image], out: Path) -> None:
    """The samples as `0000.png`, `0001.png`, ... in `out` (created)."""
    out.mkdir(parents=True, exist_ok=True)
    for i, frame in enumerate(frames):
        frame.save(out / f"{i:04d}.png", format="PNG", compress_level=PNG_COMPRESS_LEVEL)


def sample_clip(fh: IO[bytes], spec: ClipSpec, out: Path) -> dict[str, Any]:
    """Check the clip in `fh` (header, then packets), decode its samples into `out`; the row's facts.

    Raises Reject for every way the clip fails (see the module's docstring).
    """
    import av

    header = _read_header(av, fh, spec)
    span = _count_packets(av, fh, spec, header)
    count = frame_count(span, spec)
    size = bucket_size(header["source_width"], header["source_height"], spec)
    frames = _decode(av, fh, spec, count, size)
    write_frames(frames, out)
    return {**header, "width": size[0], "height": size[1], "frames": count, "fps": spec.fps,
            "source_seconds": round(span + 1 / header["source_fps"] if header["source_fps"] else span, 3)}


def _open(av: Any, fh: IO[bytes]) -> Any:
    fh.seek(0)
    try:
        return av.open(fh, mode="r", metadata_errors="ignore")
    except av.error.FFmpegError as err:
        _out_of_memory(err)
        raise Reject("corrupt", f"FFmpeg cannot read it (truncated, damaged or no video format): {err}") from None


def _out_of_memory(err: Exception) -> None:
    """FFmpeg's ENOMEM (the child's address-space cap reached) is the memory bound, not a damaged file."""
    if isinstance(err, MemoryError):
        raise MemoryError(str(err)) from None


def _seconds(value: int | None, base: Fraction | None) -> float | None:
    return float(value * base) if value is not None and base is not None and value > 0 else None


def _read_header(av: Any, fh: IO[bytes], spec: ClipSpec) -> dict[str, Any]:
    with _open(av, fh) as container:
        if not container.streams.video:
            raise Reject("not_a_video", f"no video stream ({container.format.name}); "
                                        f"streams: {[s.type for s in container.streams] or 'none'}")
        stream = container.streams.video[0]
        codec = stream.codec_context
        if codec is None:
            raise Reject("not_a_video", f"no decoder for its video codec ({stream.codec_tag or 'unknown'})")
        check_size(codec.width, codec.height, spec)
        rate = stream.average_rate or stream.guessed_rate
        header_seconds = _seconds(stream.duration, stream.time_base) or _seconds(container.duration, Fraction(1, 10**6))
        if header_seconds is not None and header_seconds > spec.max_seconds:
            raise Reject("too_long", f"its header states {header_seconds:,.1f} s > ingest.video.max_seconds "
                                     f"{spec.max_seconds:g}")
        return {"codec": codec.name, "container": container.format.name,
                "source_width": codec.width, "source_height": codec.height,
                "source_fps": round(float(rate), 3) if rate else None, "header_frames": stream.frames or None,
                "header_seconds": header_seconds}


def _count_packets(av: Any, fh: IO[bytes], spec: ClipSpec, header: dict[str, Any]) -> float:
    """Demux (no decoding) the video packets: their count and the span of their times, checked against
    the header (truncation) and max_seconds. Returns the span, first frame to last, in seconds."""
    cap = int(spec.max_seconds * MAX_PACKET_RATE) + 1
    count, first, last = 0, math.inf, -math.inf
    with _open(av, fh) as container:
        stream = container.streams.video[0]
        base = stream.time_base
        try:
            for packet in container.demux(stream):
                if packet.size == 0:  # the demuxer's end-of-stream marker
                    continue
                count += 1
                if packet.pts is not None:
                    t = float(packet.pts * base)
                    first, last = min(first, t), max(last, t)
                if count > cap or last - first > spec.max_seconds:
                    raise Reject("too_long", f"over ingest.video.max_seconds {spec.max_seconds:g}: "
                                             f"{count} frames span {max(0.0, last - first):.1f} s and go on")
        except av.error.FFmpegError as err:
            _out_of_memory(err)
            raise Reject("corrupt", f"damaged after {count} frames: {err}") from None
    header["source_frames"] = count
    if count == 0:
        raise Reject("too_short", "0 frames: the file holds no video packet")
    listed, stated = header.pop("header_frames"), header.pop("header_seconds")
    if listed and count < listed:
        raise Reject("corrupt", f"truncated: {count} of the {listed} frames its header lists")
    span = last - first if first <= last else (count - 1) / (header["source_fps"] or spec.fps)
    frame_time = 1 / header["source_fps"] if header["source_fps"] else 0.0
    if stated and span + frame_time < stated - max(0.25, 2 * frame_time):
        raise Reject("corrupt", f"truncated: its frames end at {span + frame_time:.2f} s of the "
                                f"{stated:.2f} s its header states")
    return span


def _decode(av: Any, fh: IO[bytes], spec: ClipSpec, count: int, size: tuple[int, int]) -> list[Image.Image]:
    """Decode from the start up to the last sample; sample i is the frame nearest i / fps after the first."""
    samples: list[Image.Image] = []
    with _open(av, fh) as container:
        stream = container.streams.video[0]
        # One decoding thread: the stage runs a worker per CPU already, and FFmpeg's automatic count
        # (one per core, each with its frames) would make the memory a clip needs depend on the machine.
        stream.codec_context.thread_count = 1
        rate = float(stream.average_rate or stream.guessed_rate or spec.fps)
        start, prev, prev_t, index = None, None, 0.0, 0
        try:
            for frame in container.decode(stream):
                t = frame.time if frame.time is not None else index / rate
                index += 1
                start = t if start is None else start
                while len(samples) < count and t - start >= len(samples) / spec.fps - 1e-6:
                    slot = start + len(samples) / spec.fps
                    nearest = frame if prev is None or abs(t - slot) <= abs(slot - prev_t) else prev
                    samples.append(fit_to_bucket(nearest.to_image(), size))
                if len(samples) == count:
                    break
                prev, prev_t = frame, t
        except av.error.FFmpegError as err:
            _out_of_memory(err)
            raise Reject("corrupt", f"decoding failed after {index} frames: {err}") from None
    if len(samples) < count:
        raise Reject("corrupt", f"truncated: {index} frames decoded, {count} samples needed")
    return samples
