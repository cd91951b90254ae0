"""Draw the two-concept demo: the toy robot and a beach ball, as kohya-style concept folders.

    python data/demo/concepts.py [--out data/demo/concepts]

What a user's dataset often looks like, in small:
- `3_sks toy/`: the six robot pictures of generate.py (3 repeats per epoch). Four have a subject
  mask beside them (`<stem>-masklabel.png`: white on the robot, black elsewhere, drawn from the
  same shapes); three have a caption file, three have none.
- `2_zwx ball/`: four pictures of a striped beach ball (2 repeats), with no caption files and no
  masks (kohya's folder name, "zwx ball", is their caption; a captioner or a mask model at ingest
  can fill both).

Deterministic bytes, written atomically, as generate.py (which it reuses for scenes and the robot).
"""
from __future__ import annotations

import io
import random
import sys
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw

sys.path.insert(0, str(Path(__file__).resolve().parent))  # generate.py, beside this file
import generate  # found on the path just added

DEFAULT_OUT = Path(__file__).resolve().parent / "concepts"
ROBOT_FOLDER, BALL_FOLDER = "3_sks toy", "2_zwx ball"
MASKED = ("sks_00", "sks_01", "sks_03", "sks_04")  # robot shots with a mask file
CAPTIONED = ("sks_00", "sks_02", "sks_05")  # robot shots with a caption file
STRIPES = ((220, 40, 40), (250, 250, 250), (40, 90, 220), (250, 205, 40), (250, 250, 250), (40, 170, 80))


@dataclass(frozen=True)
class BallShot:
    stem: str
    scene: str  # a generate.py scene
    cx: float  # centre, as fractions of the image
    cy: float
    radius: float  # fraction of the image side
    turn: float  # degrees the stripes are turned


BALL_SHOTS = (
    BallShot("zwx_00", "grass", 0.45, 0.70, 0.22, 0),
    BallShot("zwx_01", "wood", 0.60, 0.62, 0.18, 25),
    BallShot("zwx_02", "tiles", 0.50, 0.55, 0.30, 50),
    BallShot("zwx_03", "blue", 0.35, 0.60, 0.20, 75),
)


def _ball(draw: ImageDraw.ImageDraw, shot: BallShot) -> None:
    s = generate.SIZE * generate.SS
    cx, cy, r = s * shot.cx, s * shot.cy, s * shot.radius
    bbox = (round(cx - r), round(cy - r), round(cx + r), round(cy + r))
    for k, colour in enumerate(STRIPES):
        start = shot.turn + k * 60
        draw.pieslice(bbox, start, start + 60, fill=colour)
    draw.ellipse(bbox, outline=generate.BLACK, width=round(r * 0.04))
    generate._disc(draw, cx, cy, r * 0.16, (250, 250, 250), edge=r * 0.03)


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG", optimize=False, compress_level=9)
    return buf.getvalue()


def robot_mask(shot: generate.Shot) -> bytes:
    """The robot's silhouette: drawn alone on black (its darkest colour is not black), 255 inside."""
    canvas = Image.new("RGB", (generate.SIZE * generate.SS,) * 2)
    generate._robot(ImageDraw.Draw(canvas), shot)
    solid = canvas.convert("L").point(lambda v: 255 if v else 0)
    small = solid.resize((generate.SIZE, generate.SIZE), Image.Resampling.BOX)
    return _png(small.point(lambda v: 255 if v >= 128 else 0))


def render_ball(shot: BallShot) -> bytes:
    canvas = Image.new("RGB", (generate.SIZE * generate.SS,) * 2)
    draw = ImageDraw.Draw(canvas)
    generate._scene(draw, shot.scene, random.Random(shot.stem))
    _ball(draw, shot)
    return _png(canvas.resize((generate.SIZE, generate.SIZE), Image.Resampling.LANCZOS))


def build() -> dict[str, bytes]:
    """Every file of the set, by path relative to the output folder."""
    files: dict[str, bytes] = {}
    for shot in generate.SHOTS:
        files[f"{ROBOT_FOLDER}/{shot.stem}.png"] = generate.render(shot)
        if shot.stem in CAPTIONED:
            files[f"{ROBOT_FOLDER}/{shot.stem}.txt"] = (shot.caption + "\n").encode()
        if shot.stem in MASKED:
            files[f"{ROBOT_FOLDER}/{shot.stem}-masklabel.png"] = robot_mask(shot)
    for ball in BALL_SHOTS:
        files[f"{BALL_FOLDER}/{ball.stem}.png"] = render_ball(ball)
    return files


def main(argv: list[str] | None = None) -> int:
    return generate.cli(__doc__, DEFAULT_OUT, build, f"{ROBOT_FOLDER}: {len(generate.SHOTS)} images, "
                        f"{BALL_FOLDER}: {len(BALL_SHOTS)} images", argv)

if __name__ == "__main__":
    sys.exit(main())
