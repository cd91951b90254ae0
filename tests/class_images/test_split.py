"""Class images split over 2 ranks (a real `mpirun -np 2` through `python -m tasks.class_images`)
give the files of a 1-rank run: same names, same pixels, same metadata; images already there are
reused, and only rank 0 reports."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from tasks.class_images.config import ClassImagesConfig
from tasks.class_images.core import run
from tests.conftest import REPO, stage_runs

SETTINGS = dict(num_images=6, resolution=32, batch_size=2, num_inference_steps=2)


@pytest.mark.skipif(shutil.which("mpirun") is None,
                    reason="needs mpirun: apt-get install openmpi-bin (.ci/run installs it)")
def test_two_ranks_make_the_images_of_one(tmp_path: Path, tiny_sd: Path, tiny_pipe, isolated_mlflow: str) -> None:
    import torch

    torch.set_num_threads(1)  # as each rank (threads_per_process: 1)
    one = tmp_path / "one"
    run(ClassImagesConfig(**SETTINGS), tiny_sd, one, pipe=tiny_pipe)
    split = tmp_path / "split"
    split.mkdir()
    for name in ("00000.png", "00001.png", "generation.json"):  # a run killed after two images
        shutil.copy(one / name, split / name)
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"class_images": {
        **SETTINGS, "launcher": "mpirun", "launch": {"num_processes": 2, "threads_per_process": 1}}}))
    done = subprocess.run(
        [sys.executable, "-m", "tasks.class_images", "--base", str(tiny_sd), "--out", str(split),
         "--report", str(tmp_path / "report.json"), "--params", str(params)],
        capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "4 to generate (2 by rank 1 of 2), 2 reused" in done.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert (report["generated"], report["reused"]) == (4, 2)
    assert len(stage_runs(isolated_mlflow)) == 1, "one MLflow run: rank 0's"
    names = sorted(p.name for p in one.iterdir())
    assert sorted(p.name for p in split.iterdir()) == names
    assert (split / "metadata.jsonl").read_text() == (one / "metadata.jsonl").read_text()
    for name in names:
        if name.endswith(".png"):
            a = np.asarray(Image.open(one / name), dtype=np.int16)
            b = np.asarray(Image.open(split / name), dtype=np.int16)
            assert np.abs(a - b).max() <= 1, name
