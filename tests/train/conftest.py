"""Tiny base models (built once per session) and small synthetic imagefolders for training tests."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """One intra-op thread: on a 2-core machine shared with other work, torch's default (one per
    core, spinning while they wait) makes the tiny models several times slower, not faster."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _builtin(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    from tasks.common.families import build_tiny_pipeline

    return build_tiny_pipeline(f"builtin:tiny-{name}", 0, tmp_path_factory.mktemp("base") / f"tiny-{name}")


@pytest.fixture(scope="session")
def tiny_sd(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _builtin(tmp_path_factory, "sd")


@pytest.fixture(scope="session")
def tiny_sdxl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _builtin(tmp_path_factory, "sdxl")


@pytest.fixture(params=["sd", "sdxl"])
def tiny_base(request: pytest.FixtureRequest) -> Path:
    """Each family in turn."""
    return request.getfixturevalue(f"tiny_{request.param}")


def write_imagefolder(folder: Path, n: int, text: str, seed: int, size: tuple[int, int] = (64, 64),
                      extra: list[dict] | None = None) -> Path:
    """`n` smooth random RGB images with metadata.jsonl (file_name, text, plus `extra[i]` columns)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    with open(folder / "metadata.jsonl", "w") as fh:
        for i in range(n):
            small = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
            Image.fromarray(small).resize(size, Image.Resampling.BICUBIC).save(folder / f"img{i}.png")
            row = {"file_name": f"img{i}.png", "text": text, **((extra or [{}] * n)[i])}
            fh.write(json.dumps(row) + "\n")
    return folder


@pytest.fixture(scope="session")
def instance_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # One non-square image: exercises resize + crop (and SDXL's original-size conditioning).
    folder = write_imagefolder(tmp_path_factory.mktemp("processed") / "processed", 2, "a photo of sks toy", 0)
    write_imagefolder(folder / "wide", 1, "", 1, size=(96, 64))
    with open(folder / "metadata.jsonl", "a") as fh:
        fh.write(json.dumps({"file_name": "wide/img0.png", "text": "a photo of sks toy"}) + "\n")
    return folder


@pytest.fixture(scope="session")
def one_image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A single captioned image: the fixed batch the methods overfit."""
    return write_imagefolder(tmp_path_factory.mktemp("one") / "one", 1, "a photo of sks toy", 5, size=(32, 32))


@pytest.fixture(scope="session")
def class_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_imagefolder(tmp_path_factory.mktemp("class") / "class_images", 4, "a photo of a toy", 2)


@pytest.fixture(scope="session")
def tiny_sd3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _builtin(tmp_path_factory, "sd3")


@pytest.fixture(scope="session")
def tiny_flux(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _builtin(tmp_path_factory, "flux")


@pytest.fixture(scope="session")
def tiny_flux2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _builtin(tmp_path_factory, "flux2")


@pytest.fixture(scope="session")
def tiny_kontext(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _builtin(tmp_path_factory, "flux-kontext")


@pytest.fixture(scope="session")
def tiny_qwenimage_edit(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _builtin(tmp_path_factory, "qwenimage-edit")


@pytest.fixture(scope="session")
def tiny_zimage(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _builtin(tmp_path_factory, "zimage")


@pytest.fixture(scope="session")
def tiny_qwenimage(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _builtin(tmp_path_factory, "qwenimage")


@pytest.fixture(scope="session")
def tiny_sana(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _builtin(tmp_path_factory, "sana")


@pytest.fixture(params=["sd3", "flux", "flux2", "zimage", "qwenimage", "sana"])
def flow_base(request: pytest.FixtureRequest) -> Path:
    """Each flow-matching transformer family in turn."""
    return request.getfixturevalue(f"tiny_{request.param}")


@pytest.fixture(scope="session")
def mixed_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 portrait (w 48 x h 80), 3 landscape (80 x 48) and 1 square image, the size in the metadata or not."""
    folder = tmp_path_factory.mktemp("mixed") / "processed"
    write_imagefolder(folder / "tall", 2, "", 10, size=(48, 80))
    write_imagefolder(folder / "wide", 3, "", 11, size=(80, 48))
    write_imagefolder(folder / "square", 1, "", 12, size=(64, 64))
    with open(folder / "metadata.jsonl", "w") as fh:
        for sub, n, (w, h) in (("tall", 2, (48, 80)), ("wide", 3, (80, 48)), ("square", 1, (64, 64))):
            for i in range(n):
                size = {"width": w, "height": h} if sub != "wide" else {}  # wide: read from the file
                fh.write(json.dumps({"file_name": f"{sub}/img{i}.png", "text": "a photo of sks toy", **size}) + "\n")
    return folder


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


@pytest.fixture(scope="session")
def tiny_ltx(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _builtin(tmp_path_factory, "ltx")
