"""Draw the edit demo: (reference image(s), target image, instruction) triples of the toy robot.

    python data/demo/edits.py [--out data/demo/edits]

An edit dataset in the layout ingest reads with `control_dir: control` (kohya's conditioning
folder, musubi-tuner's control_directory): each target `edit_NN.png` with its instruction
`edit_NN.txt`, its reference `control/edit_NN.png`, or several numbered `control/edit_NN_0.png`,
`control/edit_NN_1.png`. Four triples, drawn with generate.py's robot and scenes:
- edit_00..02: one reference each; the target is the same shot with another scene or pose.
- edit_03: two references (the robot on pink, an empty grass scene); the target puts that robot
  into that scene.

Deterministic bytes, written atomically, as generate.py.
"""
from __future__ import annotations

import io
import random
import sys
from dataclasses import replace
from pathlib import Path

from PIL import Image, ImageDraw

sys.path.insert(0, str(Path(__file__).resolve().parent))  # generate.py, beside this file
import generate  # found on the path just added

DEFAULT_OUT = Path(__file__).resolve().parent / "edits"
CONTROL = "control"


def _shot(stem: str) -> generate.Shot:
    return next(s for s in generate.SHOTS if s.stem == stem)


#: (stem, reference shots, target shot, instruction)
EDITS: tuple[tuple[str, tuple[generate.Shot, ...], generate.Shot, str], ...] = (
    ("edit_00", (_shot("sks_00"),), replace(_shot("sks_00"), scene="grass"), "put the toy on the grass"),
    ("edit_01", (_shot("sks_02"),), replace(_shot("sks_02"), scene="bricks"), "move the toy in front of a brick wall"),
    ("edit_02", (_shot("sks_04"),), replace(_shot("sks_04"), left_arm=150, right_arm=150),
     "make the toy raise both arms"),
)
MERGE = ("edit_03", _shot("sks_03"), "grass", "put the toy from the first picture into the scene of the second")


def scene_only(name: str, seed: str) -> bytes:
    """A scene without the robot (the same scene as a render seeded with `seed`)."""
    canvas = Image.new("RGB", (generate.SIZE * generate.SS,) * 2)
    generate._scene(ImageDraw.Draw(canvas), name, random.Random(seed))
    buf = io.BytesIO()
    canvas.resize((generate.SIZE, generate.SIZE), Image.Resampling.LANCZOS).save(
        buf, format="PNG", optimize=False, compress_level=9)
    return buf.getvalue()


def build() -> dict[str, bytes]:
    """Every file of the set, by path relative to the output folder."""
    files: dict[str, bytes] = {}
    for stem, refs, target, instruction in EDITS:
        files[f"{stem}.png"] = generate.render(target)  # seeded as its reference: the same scene details
        files[f"{stem}.txt"] = (instruction + "\n").encode()
        for ref in refs:
            files[f"{CONTROL}/{stem}.png"] = generate.render(ref)
    stem, robot, scene, instruction = MERGE
    files[f"{stem}.png"] = generate.render(replace(robot, stem=stem, scene=scene))
    files[f"{stem}.txt"] = (instruction + "\n").encode()
    files[f"{CONTROL}/{stem}_0.png"] = generate.render(robot)
    files[f"{CONTROL}/{stem}_1.png"] = scene_only(scene, stem)
    return files


def main(argv: list[str] | None = None) -> int:
    return generate.cli(__doc__, DEFAULT_OUT, build,
                        f"{len(EDITS) + 1} targets with instructions, references in {CONTROL}/", argv)

if __name__ == "__main__":
    sys.exit(main())
