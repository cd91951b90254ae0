"""Tiny model folders for registration: a real tiny SD pipeline and its real OpenVINO export.

The export takes about a minute on two busy cores, so the pair is cached in pytest's cache
(.pytest_cache), keyed by the builder's source and the library versions; a changed builder or
library builds a fresh pair. Built in a temporary folder and renamed, so an interrupted build is
never reused.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO


def _key() -> str:
    h = hashlib.sha256()
    for path in ("tiny.py", "sd.py"):
        h.update((REPO / "tasks/common/families" / path).read_bytes())
    for pkg in ("diffusers", "transformers", "optimum-intel", "openvino", "torch"):
        h.update(f"{pkg}={importlib.metadata.version(pkg)}".encode())
    return h.hexdigest()[:16]


def _build(dst: Path) -> None:
    from optimum.intel import OVStableDiffusionPipeline

    from tasks.common.families import build_tiny_pipeline

    finetuned = build_tiny_pipeline("builtin:tiny-sd", 0, dst / "finetuned")
    ov = OVStableDiffusionPipeline.from_pretrained(finetuned, export=True, compile=False)
    ov.reshape(batch_size=1, height=64, width=64, num_images_per_prompt=1)
    ov.save_pretrained(dst / "openvino")


@pytest.fixture(scope="session")
def tiny_models(request: pytest.FixtureRequest) -> Path:
    """A folder with `finetuned/` (diffusers pipeline) and `openvino/` (its static 64 px export)."""
    cache = Path(request.config.cache.mkdir("tiny-sd-openvino"))
    ready = cache / _key()
    if not (ready / "openvino" / "model_index.json").is_file():
        tmp = cache / f".build-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        _build(tmp)
        shutil.rmtree(ready, ignore_errors=True)
        os.replace(tmp, ready)
    return ready


# The evaluate stage's report shape: {"metrics": {...}, "gate": {"passed": bool, "checks": {...}}}
EVAL_PASS = {"metrics": {"clip_t": 0.21, "clip_i": 0.5, "dino": 0.4},
             "gate": {"passed": True, "checks": {"clip_t": True}}}
EVAL_FAIL = {"metrics": {"clip_t": 0.01, "clip_i": 0.1, "dino": 0.05},
             "gate": {"passed": False, "checks": {"clip_t": False}}}

# What the train stage's report says trained (tasks/train/trained.py): the keys a version is tagged with.
TRAIN_REPORT = {"method": "dreambooth", "family": "sd", "train_text_encoder": False, "optimizer": "adamw",
                "instance_images": 3, "masked_loss": False, "steps": 3, "final_loss": 0.1,
                "base_model_precision": "none", "text_encoder_precision": "none"}

DVC_LOCK = """\
schema: '2.0'
stages:
  ingest:
    cmd: python -m tasks.ingest --out data/processed
    params:
      params.yaml:
        ingest:
          resolution: 64
    outs:
    - path: data/processed
      hash: md5
      md5: 11111111111111111111111111111111.dir
      size: 10
      nfiles: 2
  train:
    cmd: python -m tasks.train --out models/finetuned
    params:
      params.yaml:
        train:
          method: dreambooth
          max_train_steps: 3
          prompts:
          - a
          - b
    outs:
    - path: models/finetuned
      hash: md5
      md5: 22222222222222222222222222222222.dir
      size: 10
      nfiles: 2
  export:
    cmd: python -m tasks.export --out models/openvino
    outs:
    - path: models/openvino
      hash: md5
      md5: 33333333333333333333333333333333.dir
      size: 10
      nfiles: 2
    - path: reports/export.json
      hash: md5
      md5: 44444444444444444444444444444444
      size: 10
"""


def write_plots(reports: Path) -> None:
    """What the evaluate and train stages draw: reports/evaluate/grid.png and grid_base.png (a
    row of two images each), and reports/train_loss.csv (step,loss,lr)."""
    from PIL import Image

    (reports / "evaluate").mkdir(parents=True, exist_ok=True)
    for name, color in (("grid.png", (200, 40, 40)), ("grid_base.png", (40, 40, 200))):
        Image.new("RGB", (128, 64), color).save(reports / "evaluate" / name)
    (reports / "train_loss.csv").write_text("step,loss,lr\n1,0.3,0.0001\n2,0.2,0.0001\n3,0.1,0.0001\n")


@pytest.fixture
def project(tmp_path: Path, tiny_models: Path) -> Path:
    """A pipeline workspace after `dvc repro`: params, dvc.lock, the models, a git commit."""
    import json

    root = tmp_path / "project"
    (root / "models").mkdir(parents=True)
    (root / "reports").mkdir()
    shutil.copytree(tiny_models / "finetuned", root / "models/finetuned")
    shutil.copytree(tiny_models / "openvino", root / "models/openvino")
    (root / "params.yaml").write_text("train:\n  max_train_steps: 3\nregister:\n  model_name: sd-test\n")
    (root / "dvc.lock").write_text(DVC_LOCK)
    (root / "reports/evaluate.json").write_text(json.dumps(EVAL_PASS))
    (root / "reports/train.json").write_text(json.dumps(TRAIN_REPORT))
    write_plots(root / "reports")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@localhost"]
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    subprocess.run(["git", "add", "params.yaml", "dvc.lock"], cwd=root, check=True)
    subprocess.run([*git, "commit", "-q", "-m", "x"], cwd=root, check=True)
    return root
