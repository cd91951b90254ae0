"""The demo subject generator: deterministic bytes, six captioned pictures of one consistent toy."""
from __future__ import annotations

import hashlib
import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tasks.common.outputs import OUTPUT_MARKER
from tests.conftest import REPO

pytestmark = pytest.mark.quick  # make test-fast

SCRIPT = REPO / "data" / "demo" / "generate.py"


def load_generator():
    spec = importlib.util.spec_from_file_location("demo_generate", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def digest(folder: Path) -> dict[str, str]:
    """{name: sha256} of the demo's files (the output marker, the same in every output, left out)."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())
            if p.name != OUTPUT_MARKER}


def test_script_output_is_byte_identical_across_runs(tmp_path: Path) -> None:
    for name in ("a", "b"):
        subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / name)], check=True)
    assert digest(tmp_path / "a") == digest(tmp_path / "b")
    gen = load_generator()
    in_process = {n: hashlib.sha256(b).hexdigest() for n, b in gen.build().items()}
    assert in_process == digest(tmp_path / "a")


def test_six_images_with_captions(tmp_path: Path) -> None:
    gen = load_generator()
    gen.main(["--out", str(tmp_path / "s")])
    files = sorted(p.name for p in (tmp_path / "s").iterdir() if p.name != OUTPUT_MARKER)
    assert (tmp_path / "s" / OUTPUT_MARKER).is_file()  # written by atomic_dir: a rerun may replace the folder
    stems = sorted({Path(f).stem for f in files})
    assert len(stems) == 6
    assert files == sorted([f"{s}.png" for s in stems] + [f"{s}.txt" for s in stems])
    for stem in stems:
        caption = (tmp_path / "s" / f"{stem}.txt").read_text()
        assert caption.endswith("\n") and "sks toy" in caption and caption.count("\n") == 1
        im = Image.open(tmp_path / "s" / f"{stem}.png")
        assert im.size == (128, 128) and im.mode == "RGB"
    assert len(set(digest(tmp_path / "s").values())) == 12  # every picture and caption differs


def test_every_picture_shows_the_same_toy(tmp_path: Path) -> None:
    """The subject's palette (red body, cyan eyes, yellow star) appears in every picture."""
    gen = load_generator()
    gen.main(["--out", str(tmp_path / "s")])
    for png in sorted((tmp_path / "s").glob("*.png")):
        px = np.asarray(Image.open(png)).astype(int).reshape(-1, 3)
        for colour, min_pixels in ((gen.RED, 40), (gen.CYAN, 4), (gen.YELLOW, 4)):
            near = (np.abs(px - np.array(colour)).max(axis=1) < 30).sum()
            assert near >= min_pixels, f"{png.name}: too few pixels of {colour}"


def test_rerun_leaves_identical_folder_untouched_and_repairs_a_changed_one(tmp_path: Path) -> None:
    gen = load_generator()
    out = tmp_path / "s"
    assert gen.write(out, gen.build()) is True
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert gen.write(out, gen.build()) is False
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == mtimes
    before = digest(out)
    (out / "sks_00.txt").write_text("edited\n")
    (out / "extra.png").write_bytes(b"x")
    assert gen.write(out, gen.build()) is True
    assert digest(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["s"]  # no temporary folders left behind


def test_the_concepts_demo_has_two_kohya_folders_masks_and_missing_captions(tmp_path: Path) -> None:
    script = REPO / "data" / "demo" / "concepts.py"
    subprocess.run([sys.executable, str(script), "--out", str(tmp_path / "a")], check=True)
    files = {p.relative_to(tmp_path / "a").as_posix(): p for p in sorted((tmp_path / "a").rglob("*.*"))
             if p.name != OUTPUT_MARKER}
    spec = importlib.util.spec_from_file_location("demo_concepts", script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    built = module.build()  # a second drawing, in this process: the same bytes
    assert set(built) == set(files) and all(files[n].read_bytes() == b for n, b in built.items())
    images = [n for n in files if n.endswith(".png") and not n.endswith("-masklabel.png")]
    assert sorted({n.split("/")[0] for n in images}) == ["2_zwx ball", "3_sks toy"] and len(images) == 10
    masks = [n for n in files if n.endswith("-masklabel.png")]
    captions = [n for n in files if n.endswith(".txt")]
    assert len(masks) == 4 and len(captions) == 3, "some robot images have masks, some captions; the ball none"
    for mask in masks:
        image = np.asarray(Image.open(files[mask.replace("-masklabel", "")]).convert("RGB")).astype(int)
        m = np.asarray(Image.open(files[mask]))
        assert m.shape == image.shape[:2] and set(np.unique(m)) == {0, 255}
        red = (image[..., 0] > 150) & (image[..., 1] < 80) & (image[..., 2] < 80)  # the robot's red body
        assert red.sum() > 50 and (m[red] == 255).mean() > 0.95, "the mask covers the robot"
        assert 0.02 < (m == 255).mean() < 0.6, "and not the whole picture"


def test_the_edit_demo_ingests_as_triples(tmp_path: Path) -> None:
    """data/demo/edits.py: deterministic, and ingest with control_dir keeps every target with its references."""
    from tests.ingest.util import config, run

    script = REPO / "data" / "demo" / "edits.py"
    subprocess.run([sys.executable, str(script), "--out", str(tmp_path / "edits")], check=True)
    spec = importlib.util.spec_from_file_location("demo_edits", script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    built = module.build()
    assert all((tmp_path / "edits" / n).read_bytes() == b for n, b in built.items())
    src = {"type": "folder", "path": str(tmp_path / "edits"), "control_dir": "control"}
    r = run(config([src], near_duplicate_distance=None), tmp_path / "out")
    assert not r.rejected and len(r.kept) == 4
    refs = {row["path"]: len(row["reference_file_names"]) for row in r.kept}
    assert refs == {"edit_00.png": 1, "edit_01.png": 1, "edit_02.png": 1, "edit_03.png": 2}
    assert {row["text"] for row in r.kept} >= {"put the toy on the grass", "make the toy raise both arms"}
