"""Draw the demo subject: six small pictures of one toy robot, each with a caption file.

    python data/demo/generate.py [--out data/demo/subject]

Why procedural: the repository commits no opaque binaries, yet the offline demo needs a
DreamBooth-style instance set, i.e. one subject with consistent features (red body, silver head,
cyan eyes, yellow antenna ball, star on the chest) seen in varied poses, places and sizes.

The output is byte-for-byte identical on every run (fixed seeds, integer geometry, PNG without
timestamps), because DVC hashes the folder: regenerating must not look like a data change. When
the folder already holds exactly these bytes nothing is touched; otherwise the new set is written
to a temporary sibling and swapped in, so a crash never leaves a half-written folder. The folder
carries the stage outputs' marker (tasks/common/outputs.py), which ingest does not read as data.

Only the standard library and Pillow are used, so it runs before (or without) the project install.
"""
from __future__ import annotations

import argparse
import io
import math
import os
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from anywhere
from tasks.common.outputs import OUTPUT_MARKER, atomic_dir

SIZE = 128  # output side in pixels
SS = 4  # supersampling factor: draw at 512 px, downsample once for smooth edges
DEFAULT_OUT = Path(__file__).resolve().parent / "subject"
TOKEN = "sks toy"  # the DreamBooth identifier + class, as in params.yaml's prompts

# The subject's palette: the same in every picture, so it is recognisably one toy.
RED = (200, 38, 38)
DARK_RED = (130, 20, 24)
SILVER = (196, 200, 210)
CYAN = (40, 210, 230)
YELLOW = (250, 205, 40)
NAVY = (30, 40, 90)
BLACK = (20, 20, 24)
ORANGE = (240, 130, 30)


@dataclass(frozen=True)
class Shot:
    """One picture: where the robot stands, how big, its pose and the scene behind it."""

    stem: str
    scene: str  # key into SCENES
    cx: float  # robot centre x, as a fraction of the image
    base: float  # y of the feet, as a fraction of the image
    scale: float  # 1.0: the robot is about 70 % of the image tall
    left_arm: float  # degrees from hanging straight down, positive = raised outward
    right_arm: float
    head_tilt: float  # degrees, positive = clockwise
    caption: str


SHOTS: tuple[Shot, ...] = (
    # stem      scene     cx    base  scale  arms      tilt  caption
    Shot("sks_00", "blue", 0.50, 0.90, 1.00, 20, 20, 0,
         "a photo of sks toy on a blue background"),
    Shot("sks_01", "grass", 0.38, 0.92, 0.80, 150, 25, -8,
         "a photo of sks toy waving on the grass"),
    Shot("sks_02", "wood", 0.60, 0.95, 0.65, 160, 160, 6,
         "a photo of sks toy on a wooden table"),
    Shot("sks_03", "pink", 0.50, 0.96, 1.15, 60, 95, 10,
         "a close-up photo of sks toy on a pink background"),
    Shot("sks_04", "tiles", 0.30, 0.80, 0.50, 5, 120, 0,
         "a photo of a small sks toy on a tiled floor"),
    Shot("sks_05", "bricks", 0.66, 0.93, 0.85, 90, 90, -12,
         "a photo of sks toy in front of a grey brick wall"),
)


def _scene(draw: ImageDraw.ImageDraw, name: str, rng: random.Random) -> None:
    """Paint one of the backgrounds on the supersampled canvas."""
    s = SIZE * SS
    if name == "blue":
        draw.rectangle((0, 0, s, s), fill=(58, 110, 165))
        draw.rectangle((0, int(s * 0.82), s, s), fill=(45, 90, 140))
    elif name == "grass":
        draw.rectangle((0, 0, s, s), fill=(150, 200, 240))
        sun = (int(s * 0.7), int(s * 0.06), int(s * 0.9), int(s * 0.26))
        draw.ellipse(sun, fill=(255, 240, 150))
        draw.rectangle((0, int(s * 0.62), s, s), fill=(70, 150, 60))
        for _ in range(160):
            x, y = rng.randrange(s), rng.randrange(int(s * 0.62), s)
            blade = (x, y, x + rng.randrange(-8, 9), y - rng.randrange(10, 30))
            draw.line(blade, fill=(40, 110, 40), width=3)
    elif name == "wood":
        draw.rectangle((0, 0, s, s), fill=(235, 225, 205))
        top = int(s * 0.55)
        draw.rectangle((0, top, s, s), fill=(150, 95, 50))
        for _ in range(40):
            y = rng.randrange(top, s)
            grain = (0, y, s, y + rng.randrange(-6, 7))
            draw.line(grain, fill=(120, 72, 36), width=rng.choice((2, 3, 4)))
    elif name == "pink":
        draw.rectangle((0, 0, s, s), fill=(240, 170, 200))
        for _ in range(30):
            x, y, r = rng.randrange(s), rng.randrange(s), rng.randrange(6, 20)
            draw.ellipse((x - r, y - r, x + r, y + r), fill=(250, 200, 220))
    elif name == "tiles":
        step = s // 8
        for i in range(8):
            for j in range(8):
                shade = (225, 225, 225) if (i + j) % 2 else (150, 150, 160)
                draw.rectangle((i * step, j * step, (i + 1) * step, (j + 1) * step), fill=shade)
    elif name == "bricks":
        draw.rectangle((0, 0, s, s), fill=(90, 90, 95))
        bh, bw = s // 10, s // 5
        for row in range(11):
            offset = (bw // 2) * (row % 2)
            for col in range(-1, 6):
                x0, y0 = col * bw + offset, row * bh
                grey = 140 + rng.randrange(-15, 16)
                brick = (x0 + 3, y0 + 3, x0 + bw - 3, y0 + bh - 3)
                draw.rectangle(brick, fill=(grey, grey, grey + 5))
        draw.rectangle((0, int(s * 0.88), s, s), fill=(110, 100, 90))
    else:
        raise ValueError(f"unknown scene {name!r}")


Point = tuple[float, float]


def _rotate(points: list[Point], centre: Point, deg: float) -> list[tuple[int, int]]:
    """Rotate points about `centre` by `deg` degrees (clockwise on screen), rounded to pixels."""
    a = math.radians(deg)
    ca, sa = math.cos(a), math.sin(a)
    cx, cy = centre
    return [
        (round(cx + (x - cx) * ca - (y - cy) * sa), round(cy + (x - cx) * sa + (y - cy) * ca))
        for x, y in points
    ]


Colour = tuple[int, int, int]


def _disc(draw: ImageDraw.ImageDraw, x: float, y: float, r: float, fill: Colour, edge: float = 0):
    """A filled circle centred at (x, y); `edge` > 0 adds a black outline that wide."""
    bbox = (round(x - r), round(y - r), round(x + r), round(y + r))
    if edge:
        draw.ellipse(bbox, fill=fill, outline=BLACK, width=max(1, round(edge)))
    else:
        draw.ellipse(bbox, fill=fill)


def _robot(draw: ImageDraw.ImageDraw, shot: Shot) -> None:
    """Draw the toy robot; all sizes derive from one unit `u` so it scales as a whole."""
    s = SIZE * SS
    u = s * 0.7 * shot.scale / 10  # the robot is 10 units tall
    cx, feet = s * shot.cx, s * shot.base

    def box(x0: float, y0: float, x1: float, y1: float) -> tuple[int, int, int, int]:
        return (round(cx + x0 * u), round(feet - y1 * u), round(cx + x1 * u), round(feet - y0 * u))

    # legs and feet
    for side in (-1, 1):
        draw.rectangle(box(side * 1.1 - 0.55, 0.4, side * 1.1 + 0.55, 2.4), fill=NAVY)
        foot = box(side * 1.1 - 0.9, 0.0, side * 1.1 + 0.9, 0.6)
        draw.rounded_rectangle(foot, radius=round(0.2 * u), fill=BLACK)
    # arms: thick segments from the shoulders, rotated outward, with round hands
    for side, angle in ((-1, shot.left_arm), (1, shot.right_arm)):
        sx, sy = cx + side * 2.1 * u, feet - 5.6 * u
        a = math.radians(angle)
        hx, hy = sx + side * math.sin(a) * 2.6 * u, sy + math.cos(a) * 2.6 * u
        draw.line((round(sx), round(sy), round(hx), round(hy)), fill=ORANGE, width=round(0.7 * u))
        _disc(draw, hx, hy, 0.55 * u, SILVER, edge=0.1 * u)
    # body with a star on the chest
    body = box(-2.1, 2.2, 2.1, 6.2)
    rim = round(0.15 * u)
    draw.rounded_rectangle(body, radius=round(0.5 * u), fill=RED, outline=DARK_RED, width=rim)
    star_c = (cx, feet - 4.4 * u)
    star = []
    for k in range(10):
        rad = (0.9 if k % 2 == 0 else 0.38) * u
        ang = math.radians(-90 + 36 * k)
        star.append((star_c[0] + rad * math.cos(ang), star_c[1] + rad * math.sin(ang)))
    draw.polygon([(round(x), round(y)) for x, y in star], fill=YELLOW)
    # head (tilted as a whole around the neck), eyes, mouth grille, antenna
    neck = (cx, feet - 6.2 * u)

    def head_poly(x0: float, y0: float, x1: float, y1: float) -> list[tuple[int, int]]:
        left, right, bottom, top = cx + x0 * u, cx + x1 * u, feet - y0 * u, feet - y1 * u
        pts = [(left, bottom), (right, bottom), (right, top), (left, top)]
        return _rotate(pts, neck, shot.head_tilt)

    stalk = _rotate([(cx, feet - 8.9 * u), (cx, feet - 9.6 * u)], neck, shot.head_tilt)
    draw.line(stalk, fill=BLACK, width=round(0.2 * u))
    ax, ay = _rotate([(cx, feet - 9.65 * u)], neck, shot.head_tilt)[0]
    _disc(draw, ax, ay, 0.4 * u, YELLOW, edge=0.08 * u)
    draw.polygon(head_poly(-1.8, 6.3, 1.8, 9.0), fill=SILVER, outline=BLACK, width=round(0.12 * u))
    for side in (-1, 1):
        ex, ey = _rotate([(cx + side * 0.8 * u, feet - 7.9 * u)], neck, shot.head_tilt)[0]
        _disc(draw, ex, ey, 0.55 * u, CYAN, edge=0.08 * u)
        _disc(draw, ex, ey, 0.22 * u, BLACK)
    draw.polygon(head_poly(-0.9, 6.7, 0.9, 7.1), fill=BLACK)


def render(shot: Shot) -> bytes:
    """Draw one shot and return its PNG bytes (deterministic: seeded by the stem, no metadata)."""
    canvas = Image.new("RGB", (SIZE * SS, SIZE * SS))
    draw = ImageDraw.Draw(canvas)
    _scene(draw, shot.scene, random.Random(shot.stem))
    _robot(draw, shot)
    image = canvas.resize((SIZE, SIZE), Image.Resampling.LANCZOS)
    buf = io.BytesIO()
    image.save(buf, format="PNG", optimize=False, compress_level=9)
    return buf.getvalue()


def build() -> dict[str, bytes]:
    """All files of the demo set, by name: `<stem>.png` and `<stem>.txt` (caption + newline)."""
    files: dict[str, bytes] = {}
    for shot in SHOTS:
        files[f"{shot.stem}.png"] = render(shot)
        files[f"{shot.stem}.txt"] = (shot.caption + "\n").encode()
    return files


def _up_to_date(out: Path, files: dict[str, bytes]) -> bool:
    if not out.is_dir() or out.is_symlink():
        return False
    present = {p.relative_to(out).as_posix() for p in out.rglob("*") if not p.is_dir()} - {OUTPUT_MARKER}
    return present == set(files) and all((out / n).read_bytes() == b for n, b in files.items())


def write(out: Path, files: dict[str, bytes]) -> bool:
    """Make `files` the whole content of `out`, atomically; False when it already was."""
    if _up_to_date(out, files):
        return False
    with atomic_dir(out) as tmp:
        for name, data in files.items():  # a name may hold sub-folders ("3_sks toy/sks_00.png")
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp / name).write_bytes(data)
            os.chmod(tmp / name, 0o644)
    return True


def cli(doc: str, default_out: Path, files: Callable[[], dict[str, bytes]], what: str,
        argv: list[str] | None = None) -> int:
    """A demo script's command line: `--out`, then the files written (or up to date) and `what` they are."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=default_out, help="output folder (default: %(default)s)")
    args = parser.parse_args(argv)
    built = files()
    changed = write(args.out, built)
    print(f"{'wrote' if changed else 'up to date:'} {len(built)} files in {args.out} ({what})")
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli(__doc__, DEFAULT_OUT, build, f"{len(SHOTS)} images + {len(SHOTS)} captions", argv)


if __name__ == "__main__":
    sys.exit(main())
