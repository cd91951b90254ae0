"""Draw the demo clips: short videos of the toy robot, for the `clips` ingest source.

    python data/demo/clips.py [--out data/demo/clips]

Each clip is drawn frame by frame with generate.py's robot and scenes and encoded with PyAV (the
FFmpeg the project decodes with), 12 frames per second at 128 x 128, a few KB each:
- wave.mp4 (H.264): the robot raises its arm on the grass, 25 frames (2 s: 17 samples at 8 fps);
- nod.webm (VP9): it tilts its head on blue, 25 frames;
- walk.mov (H.264 in QuickTime): it crosses the tiles, 13 frames (1 s: 9 samples);
- broken.mp4: a clip cut half-way through (a download that stopped), which ingest rejects as
  `corrupt` with the reason, so the demo's report shows a rejection.
Each has its caption beside it (`wave.txt`, ...). Used only when asked: point ingest at it with
`ingest.data_dir: data/demo/clips` and `ingest.sources: [{type: clips}]` (tasks/ingest/README.md).

Deterministic bytes for a given PyAV (one encoder thread, no timestamps in the containers), written
atomically as generate.py writes the images.
"""
from __future__ import annotations

import io
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import av
import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))  # generate.py, beside this file
import generate  # found on the path just added

DEFAULT_OUT = Path(__file__).resolve().parent / "clips"
FPS = 12
CODECS = {"mp4": "libx264", "mov": "libx264", "webm": "libvpx-vp9"}


def _shot(stem: str) -> generate.Shot:
    return next(s for s in generate.SHOTS if s.stem == stem)


def _frames(name: str, n: int) -> list[generate.Shot]:
    """The shots of one clip: a pose that changes a little from frame to frame."""
    base = {"wave": _shot("sks_01"), "nod": _shot("sks_00"), "walk": _shot("sks_04"),
            "broken": _shot("sks_05")}[name]
    shots = []
    for i in range(n):
        k = i / max(1, n - 1)
        if name == "wave" or name == "broken":
            shots.append(replace(base, left_arm=20 + 140 * k))
        elif name == "nod":
            shots.append(replace(base, head_tilt=-15 + 30 * k))
        else:
            shots.append(replace(base, cx=0.25 + 0.5 * k))
    return shots


def encode(shots: list[generate.Shot], ext: str, options: dict[str, str] | None = None) -> bytes:
    """The shots as one clip (`ext`: mp4, mov or webm) at FPS frames per second."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"clip.{ext}"
        with av.open(str(path), "w", options={"fflags": "+bitexact", **(options or {})}) as out:
            stream = out.add_stream(CODECS[ext], rate=FPS)
            stream.width = stream.height = generate.SIZE
            stream.pix_fmt = "yuv420p"
            stream.options = ({"crf": "30", "preset": "medium", "threads": "1"} if ext != "webm" else
                              {"crf": "40", "b:v": "0", "threads": "1", "row-mt": "0"})
            stream.codec_context.flags |= av.codec.context.Flags.bitexact
            for shot in shots:
                rgb = np.asarray(Image.open(io.BytesIO(generate.render(shot))).convert("RGB"))
                out.mux(stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")))
            out.mux(stream.encode())
        return path.read_bytes()


#: (file, frames, caption)
CLIPS = (
    ("wave.mp4", 25, "a video of sks toy raising its arm on the grass"),
    ("nod.webm", 25, "a video of sks toy tilting its head on a blue background"),
    ("walk.mov", 13, "a video of a small sks toy crossing a tiled floor"),
)


def build() -> dict[str, bytes]:
    """Every file of the set, by name: the clips, their captions and the broken clip."""
    files: dict[str, bytes] = {}
    for name, n, caption in CLIPS:
        stem, ext = name.split(".")
        files[name] = encode(_frames(stem, n), ext)
        files[f"{stem}.txt"] = (caption + "\n").encode()
    whole = encode(_frames("broken", 25), "mp4", {"movflags": "faststart"})  # the index first: cut, it still opens
    files["broken.mp4"] = whole[: len(whole) // 2]
    files["broken.txt"] = b"a video of sks toy in front of a grey brick wall\n"
    return files


def main(argv: list[str] | None = None) -> int:
    return generate.cli(__doc__, DEFAULT_OUT, build, f"{len(CLIPS)} clips + a broken one, with captions", argv)


if __name__ == "__main__":
    sys.exit(main())
