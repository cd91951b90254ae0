"""Which library decodes ingest's clips: PyAV against imageio-ffmpeg, on one small clip.

    .venv/bin/python benchmarks/ingest/video_decoders.py [--extra-path DIR] [--repeat 20]

The clip: 48 frames of 256 x 256 H.264 at 24 fps (2 s, about 20 KB), encoded with PyAV. Each row
is the median (with min and max) of `--repeat` runs after one warm-up: every frame decoded to RGB24 numpy arrays, and
the header alone (what ingest reads before anything else: size, codec, fps, duration). imageio-ffmpeg
is not a project dependency: install it anywhere (`pip install --target DIR imageio-ffmpeg`) and
pass `--extra-path DIR`; without it its rows are skipped. torchvision is not installed here (it
breaks transformers' imports against torch's CPU build; Makefile), and its video reader is
deprecated (torchvision 0.22 onwards), its `read_video` reading through PyAV itself.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import av
import numpy as np


def make_clip(path: Path, n: int = 48, size: int = 256, fps: int = 24) -> None:
    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264", rate=fps)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "30", "preset": "ultrafast", "threads": "1"}
        for i in range(n):
            a = np.zeros((size, size, 3), np.uint8)
            a[..., 0] = (i * 5) % 256
            a[i * 4 % size :, :, 1] = 200
            out.mux(stream.encode(av.VideoFrame.from_ndarray(a, format="rgb24")))
        out.mux(stream.encode())


def spread_ms(fn: Callable[[], object], repeat: int) -> tuple[float, float, float]:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1000, statistics.median(times) * 1000, max(times) * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--extra-path", type=Path, help="a folder holding imageio_ffmpeg")
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    if args.extra_path:
        sys.path.append(str(args.extra_path))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "clip.mp4"
        make_clip(path)
        print(f"clip: 48 frames, 256x256 H.264, {path.stat().st_size:,} bytes; PyAV {av.__version__}")

        def pyav_frames() -> list:
            with av.open(str(path)) as c:
                return [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]

        def pyav_header() -> tuple:
            with av.open(str(path)) as c:
                s = c.streams.video[0]
                return s.codec_context.width, s.codec_context.name, s.average_rate, c.duration

        rows = [("PyAV, every frame", pyav_frames), ("PyAV, header only", pyav_header)]
        try:
            import imageio_ffmpeg
        except ImportError:
            print("imageio-ffmpeg: not importable (see --extra-path); its rows are skipped")
        else:
            def iio_frames() -> list:
                gen = imageio_ffmpeg.read_frames(str(path), pix_fmt="rgb24")
                next(gen)  # the metadata
                return [np.frombuffer(b, np.uint8) for b in gen]

            def iio_header() -> dict:
                gen = imageio_ffmpeg.read_frames(str(path))
                meta = next(gen)
                gen.close()
                return meta

            rows += [(f"imageio-ffmpeg {imageio_ffmpeg.__version__}, every frame", iio_frames),
                     ("imageio-ffmpeg, header only", iio_header)]
        for name, fn in rows:
            low, mid, high = spread_ms(fn, args.repeat)
            print(f"{name}: {mid:.1f} ms (median of {args.repeat}; min {low:.1f}, max {high:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
