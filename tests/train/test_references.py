"""Edit training on (reference images, target, instruction) triples: which families take them, and
FLUX.2 [klein] training with the reference latents in its input sequence."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tasks.common.errors import UserError
from tasks.train.config import TrainConfig
from tests.train.conftest import write_imagefolder

SEQ = 32


@pytest.fixture(scope="session")
def edit_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two 32 px targets, the first with one reference, the second with two (as ingest writes them)."""
    folder = write_imagefolder(tmp_path_factory.mktemp("edits") / "processed", 2, "make it red", 11, size=(32, 32))
    (folder / "references").mkdir()
    rows = [json.loads(line) for line in (folder / "metadata.jsonl").read_text().splitlines()]
    rng = np.random.default_rng(12)
    for row, count in zip(rows, (1, 2)):
        stem = Path(row["file_name"]).stem
        names = [f"references/{stem}.png"] if count == 1 else [f"references/{stem}_{i}.png" for i in range(count)]
        for name in names:
            Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(folder / name)
        row["reference_file_names"] = names
    (folder / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def _config(tmp_path: Path, **kw) -> TrainConfig:
    base = dict(max_train_steps=2, train_batch_size=1, resolution=32, num_validation_images=0,
                with_prior_preservation=False, checkpoints_dir=tmp_path / "ckpt", checkpointing_steps=1000)
    return TrainConfig(**{**base, **kw})


def test_a_family_without_references_refuses_an_edit_dataset(tmp_path, tiny_sd, edit_dir) -> None:
    from tasks.train.core import train

    with pytest.raises(UserError, match=r"2 of 2 instance images list reference images .*reference_file_names.*"
                                        r"Stable Diffusion.* does not train on reference images"):
        train(_config(tmp_path), tiny_sd, edit_dir, None, tmp_path / "out")


def test_a_missing_reference_file_is_named(tmp_path, edit_dir) -> None:
    from tasks.train.data import read_imagefolder

    broken = tmp_path / "broken"
    broken.mkdir()
    for p in edit_dir.rglob("*.*"):
        (broken / p.relative_to(edit_dir)).parent.mkdir(parents=True, exist_ok=True)
        (broken / p.relative_to(edit_dir)).write_bytes(p.read_bytes())
    next((broken / "references").glob("*_1.png")).unlink()
    with pytest.raises(UserError, match=r"lists the reference image\(s\) references/img1_1.png, which are missing"):
        read_imagefolder(broken, "instance images", "Rerun ingest.")
