"""Clips for the ingest tests, encoded with PyAV: a good one, and the hostile ones (truncated, a header
claiming hours, no frame at all)."""
from __future__ import annotations

import struct
from pathlib import Path

import av
import numpy as np

#: (format, codec) per extension
FORMATS = {".mp4": ("mp4", "libx264"), ".mov": ("mov", "libx264"), ".webm": ("webm", "libvpx-vp9")}


def frame(i: int, size: tuple[int, int]) -> np.ndarray:
    """Frame i: a bar that moves one step per frame over a gradient (consecutive frames differ)."""
    w, h = size
    a = np.zeros((h, w, 3), np.uint8)
    a[..., 0] = np.linspace(0, 255, w, dtype=np.uint8)[None, :]
    x = (i * 4) % w
    a[:, x : x + 6, 1] = 255
    return a


def make_clip(path: Path, frames: int = 24, size: tuple[int, int] = (64, 48), fps: int = 24,
              options: dict[str, str] | None = None) -> Path:
    """An H.264 (mp4, mov) or VP9 (webm) clip of `frames` frames; deterministic bytes."""
    fmt, codec = FORMATS[path.suffix.lower()]
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w", format=fmt, options=options or {}) as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        stream.options = {"crf": "35", "preset": "ultrafast", "threads": "1"} if codec == "libx264" else {
            "crf": "40", "b:v": "0", "threads": "1", "cpu-used": "8", "deadline": "realtime"}
        if not frames:
            out.start_encoding()  # the header, written with no packet after it
        for i in range(frames):
            out.mux(stream.encode(av.VideoFrame.from_ndarray(frame(i, size), format="rgb24")))
        out.mux(stream.encode())
    return path


def truncated(path: Path, keep: float = 0.5) -> Path:
    """A clip whose index comes first (faststart) cut to `keep` of its bytes: a download that stopped."""
    make_clip(path, frames=48, options={"movflags": "faststart"})
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    return path


def hours_long_header(path: Path, hours: float = 10) -> Path:
    """A valid 12-frame mp4 whose headers claim `hours` hours: the movie and media headers (mvhd, mdhd)
    and the sample timing table (stts), from which FFmpeg takes the stream's duration."""
    make_clip(path, frames=12, options={"use_editlist": "0"})  # no edit list to clip the times back
    data = bytearray(path.read_bytes())
    timescales = {}
    for box in (b"mvhd", b"mdhd"):
        at = data.index(box) + 4  # version (1 byte) + flags (3), then times (version 0: 32-bit fields)
        assert data[at] == 0, "version-0 box expected"
        timescales[box] = struct.unpack(">I", data[at + 12 : at + 16])[0]
        data[at + 16 : at + 20] = struct.pack(">I", int(hours * 3600 * timescales[box]))
    at = data.index(b"stts") + 8  # version/flags, then the entry count and (count, delta) entries
    (entries,) = struct.unpack(">I", data[at : at + 4])
    delta = int(hours * 3600 * timescales[b"mdhd"] / 12)
    for i in range(entries):
        data[at + 8 + 8 * i : at + 12 + 8 * i] = struct.pack(">I", delta)
    path.write_bytes(bytes(data))
    return path


def zero_frames(path: Path) -> Path:
    """An mp4 whose video track lists no sample: its sample tables (stts, stsz) emptied."""
    make_clip(path, frames=4)
    data = bytearray(path.read_bytes())
    at = data.index(b"stts") + 8
    data[at : at + 4] = struct.pack(">I", 0)  # no (count, delta) entry
    at = data.index(b"stsz") + 12  # version/flags, sample size, then the sample count
    data[at : at + 4] = struct.pack(">I", 0)
    path.write_bytes(bytes(data))
    return path


def audio_only(path: Path) -> Path:
    """An mp4 holding one AAC audio stream (a second of silence) and no video stream."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w", format="mp4") as out:
        stream = out.add_stream("aac", rate=8000)
        stream.layout = "mono"
        for i in range(8):
            samples = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
            samples.sample_rate, samples.pts = 8000, i * 1024
            out.mux(stream.encode(samples))
        out.mux(stream.encode())
    return path
