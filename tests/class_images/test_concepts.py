"""Class images per concept: a folder each, own prompt and seeds, reused, pruned, split over ranks."""
from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tasks.class_images.concepts import run_all
from tasks.class_images.config import ClassImagesConfig
from tasks.class_images.core import METADATA, STATE, load_pipeline

SETTINGS = dict(prompt="a photo of a toy", resolution=32, num_inference_steps=2, batch_size=2, seed=3)
CONCEPTS = [{"name": "sks dog", "prompt": "a photo of a dog", "num_images": 2},
            {"name": "ohwx cat", "prompt": "a photo of a cat", "num_images": 1, "negative_prompt": "blurry"}]


def cfg(concepts=CONCEPTS, **kw) -> ClassImagesConfig:
    return ClassImagesConfig(**{**SETTINGS, "num_images": 2, "concepts": concepts, **kw})


def pixels(path: Path) -> np.ndarray:
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"), dtype=np.int16)


def test_each_concept_gets_its_folder_prompt_and_seeds_then_is_reused(tmp_path: Path, tiny_sd, tiny_pipe) -> None:
    out = tmp_path / "cls"
    run_all(cfg(concepts=[]), tiny_sd, out, pipe=tiny_pipe)  # a run without concepts first: its set goes
    (out / "notes").mkdir()  # not this stage's: kept
    summary = run_all(cfg(), tiny_sd, out, pipe=tiny_pipe)
    assert (summary.generated, summary.num_images) == (3, 3)
    assert summary.report()["concepts"]["ohwx cat"]["generated"] == 1
    assert sorted(p.name for p in out.iterdir()) == ["notes", "ohwx cat", "sks dog"]
    rows = [json.loads(line) for line in (out / "sks dog" / METADATA).read_text().splitlines()]
    assert rows == [{"file_name": "00000.png", "text": "a photo of a dog"},
                    {"file_name": "00001.png", "text": "a photo of a dog"}]
    cat = json.loads((out / "ohwx cat" / STATE).read_text())
    assert (cat["seed"], cat["negative_prompt"], cat["prompt"]) == (100_003, "blurry", "a photo of a cat")
    assert json.loads((out / "sks dog" / STATE).read_text())["seed"] == 3
    again = run_all(cfg(), tiny_sd, out, pipe=tiny_pipe)
    assert (again.generated, again.reused) == (0, 3)
    run_all(cfg(concepts=CONCEPTS[:1]), tiny_sd, out, pipe=tiny_pipe)
    assert sorted(p.name for p in out.iterdir()) == ["notes", "sks dog"], "a concept no longer listed goes"


def test_two_ranks_make_the_images_of_one(tmp_path: Path, tiny_sd, tiny_pipe) -> None:
    one = tmp_path / "one"
    run_all(cfg(), tiny_sd, one, pipe=tiny_pipe)
    split, barrier = tmp_path / "split", threading.Barrier(2, timeout=120)
    pipes, errors = [tiny_pipe, load_pipeline(tiny_sd)], []

    def rank(r: int) -> None:
        try:
            run_all(cfg(), tiny_sd, split, pipe=pipes[r], rank=r, world_size=2, barrier=barrier.wait)
        except Exception as err:  # reported below
            errors.append(err)
            barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for name in ("sks dog/00000.png", "sks dog/00001.png", "ohwx cat/00000.png", "sks dog/metadata.jsonl"):
        if name.endswith(".png"):
            assert np.abs(pixels(one / name) - pixels(split / name)).max() <= 1, name
        else:
            assert (one / name).read_text() == (split / name).read_text()


@pytest.mark.quick
def test_concept_names_are_checked() -> None:
    with pytest.raises(ValueError, match="listed twice"):
        cfg(concepts=[CONCEPTS[0], CONCEPTS[0]])
    with pytest.raises(ValueError, match="folder name"):
        cfg(concepts=[{"name": "../x", "prompt": "p"}])
