"""The disk latent cache: exactly the changed image is encoded again; the training does not change."""
from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from pydantic import ValidationError
from safetensors.torch import load_file

from tasks.train.config import TrainConfig
from tasks.train.core import train
from tasks.train.latent_store import DiskLatentStore, FileHashes, vae_fingerprint
from tests.train.conftest import write_imagefolder

UNET = "unet/diffusion_pytorch_model.safetensors"


def _entries(root: Path) -> dict[Path, int]:
    """Every cache file with its inode and modification time (a rewrite changes them)."""
    return {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in root.rglob("*.safetensors")}


def _cfg(tmp_path: Path, name: str, **kw) -> TrainConfig:
    return TrainConfig(**{**dict(max_train_steps=3, train_batch_size=1, resolution=32, num_validation_images=0,
                                 with_prior_preservation=False, checkpoints_dir=tmp_path / f"ckpt-{name}",
                                 resume="none", system_metrics_interval=0, learning_rate=1e-3), **kw})


def test_a_changed_image_is_the_only_entry_encoded_again(tmp_path, tiny_sd) -> None:
    data = write_imagefolder(tmp_path / "data", 3, "a photo of sks toy", 21, size=(48, 40))
    cache = tmp_path / "latents"
    disk = dict(cache_latents_to_disk=True, disk_cache_dir=cache)
    train(_cfg(tmp_path, "m"), tiny_sd, data, None, tmp_path / "memory")
    first = train(_cfg(tmp_path, "a", **disk), tiny_sd, data, None, tmp_path / "a")
    before = _entries(cache)
    assert len(before) == 3 and len({p.parent.parent for p in before}) == 1, "3 images under one VAE folder"
    a, m = load_file(tmp_path / "a" / UNET), load_file(tmp_path / "memory" / UNET)
    assert all(torch.equal(a[k], m[k]) for k in a), "disk and memory caches train alike"

    again = train(_cfg(tmp_path, "b", **disk), tiny_sd, data, None, tmp_path / "b")
    assert _entries(cache) == before, "a second run reuses every entry, rewriting none"
    assert again.losses == first.losses

    pixels = np.asarray(Image.open(data / "img1.png")).copy()
    pixels[0, 0] = 255 - pixels[0, 0]
    Image.fromarray(pixels).save(data / "img1.png")
    train(_cfg(tmp_path, "c", **disk), tiny_sd, data, None, tmp_path / "c")
    after = _entries(cache)
    assert len(after) == 4 and {p: after[p] for p in before} == before, "one new entry, the others untouched"

    bucketed = dict(enable_bucket=True, aspect_ratio_buckets="40,48;32,32")
    train(_cfg(tmp_path, "d", **disk, **bucketed), tiny_sd, data, None, tmp_path / "d")
    assert len(_entries(cache)) == 7, "another size (the bucket) is another entry per image"


def test_an_image_whose_latent_is_cached_is_not_decoded(tmp_path, tiny_sdxl, monkeypatch) -> None:
    """Every PIL open is counted: a run over a warm cache decodes nothing and trains exactly as the run
    that decoded (SDXL: the stored original size and crop corner feed its conditioning); an edited
    image is decoded again, alone."""
    data = write_imagefolder(tmp_path / "data", 3, "a photo of sks toy", 23, size=(48, 40))  # cropped
    disk = dict(cache_latents_to_disk=True, disk_cache_dir=tmp_path / "latents")
    first = train(_cfg(tmp_path, "a", **disk), tiny_sdxl, data, None, tmp_path / "a")
    opened: list[object] = []
    real_open = Image.open
    monkeypatch.setattr(Image, "open", lambda fp, *a, **kw: opened.append(fp) or real_open(fp, *a, **kw))
    again = train(_cfg(tmp_path, "b", **disk), tiny_sdxl, data, None, tmp_path / "b")
    assert opened == [], "no image is decoded when its latent is on disk"
    assert again.losses == first.losses

    pixels = np.asarray(real_open(data / "img2.png")).copy()
    pixels[5, 5] = 255 - pixels[5, 5]
    Image.fromarray(pixels).save(data / "img2.png")
    train(_cfg(tmp_path, "c", **disk), tiny_sdxl, data, None, tmp_path / "c")
    assert len(opened) == 1, f"only the edited image is decoded again, opened: {opened}"


def test_file_hashes_follow_every_change(tmp_path, monkeypatch) -> None:
    """A remembered hash is used only while the file is untouched: same size and a restored
    modification time still count as a change (the change time moves)."""
    path, hashes = tmp_path / "a.bin", FileHashes(tmp_path / "memo")
    path.write_bytes(b"first")
    assert hashes.digest(path) == hashlib.sha256(b"first").hexdigest()
    assert not list((tmp_path / "memo").rglob("*")), "a file changed within 2 s is not remembered yet"

    monkeypatch.setattr(FileHashes, "SETTLED_NS", 0)
    hashes.digest(path)
    (memo,) = [p for p in (tmp_path / "memo").rglob("*") if p.is_file()]
    memo.write_text("f" * 64)
    assert hashes.digest(path) == "f" * 64, "an untouched file's hash is read from the memo, not computed"
    before = os.stat(path)
    time.sleep(0.05)  # past the file system's clock tick
    path.write_bytes(b"other")
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert hashes.digest(path) == hashlib.sha256(b"other").hexdigest()


def test_text_embeddings_on_disk_per_caption(tmp_path, tiny_sdxl) -> None:
    """Captions: one file per prompt (with SDXL's pooled embeds); a new caption adds only its file."""
    rows = [{"caption": f"a photo of toy number {i}"} for i in range(3)]
    data = write_imagefolder(tmp_path / "data", 3, "unused", 22, size=(32, 32), extra=rows)
    cache = tmp_path / "encoded"
    kw = dict(cache_text_encoder_outputs_to_disk=True, disk_cache_dir=cache, caption_column="caption")
    memory = train(_cfg(tmp_path, "m", caption_column="caption"), tiny_sdxl, data, None, tmp_path / "memory")
    train(_cfg(tmp_path, "a", **kw), tiny_sdxl, data, None, tmp_path / "a")
    before = _entries(cache)
    assert len(before) == 3 and all(p.parent.parent.name.startswith("text-") for p in before)
    assert set(load_file(next(iter(before)))) == {"hidden", "pooled"}
    again = train(_cfg(tmp_path, "b", **kw), tiny_sdxl, data, None, tmp_path / "b")
    assert _entries(cache) == before and again.losses == memory.losses, "reused, and trains as from memory"
    lines = (data / "metadata.jsonl").read_text().replace("number 2", "number 9")
    (data / "metadata.jsonl").write_text(lines)
    train(_cfg(tmp_path, "c", **kw), tiny_sdxl, data, None, tmp_path / "c")
    after = _entries(cache)
    assert len(after) == 4 and {p: after[p] for p in before} == before


def test_the_vae_and_its_precision_name_the_folder(tmp_path) -> None:
    vae = torch.nn.Conv2d(3, 8, 3)
    fingerprint = vae_fingerprint(vae)
    assert DiskLatentStore(tmp_path, vae).folder.name == fingerprint[:32]
    with torch.no_grad():
        vae.weight[0, 0, 0, 0] += 1
    assert vae_fingerprint(vae) != fingerprint
    assert vae_fingerprint(vae.to(torch.bfloat16)) != vae_fingerprint(vae.float())


def test_disk_cache_needs_the_cache() -> None:
    with pytest.raises(ValidationError, match="cache_latents_to_disk needs cache_latents"):
        TrainConfig(cache_latents=False, cache_latents_to_disk=True)
    with pytest.raises(ValidationError, match="cache_text_encoder_outputs_to_disk needs cache_text_encoder_outputs"):
        TrainConfig(cache_text_encoder_outputs=False, cache_text_encoder_outputs_to_disk=True)


def test_the_latent_cache_is_filled_before_the_first_step(tmp_path, tiny_sd, monkeypatch) -> None:
    """Every crop an epoch can need (3 images x 2 flips) is encoded before step 1, though the run's 2
    steps see only 2 of them, and no VAE encoding happens inside a step: each step's time is what a
    long run sees. The time it took is in the report."""
    from diffusers import AutoencoderKL

    data = write_imagefolder(tmp_path / "data", 3, "a photo of sks toy", 24, size=(48, 40))
    disk = dict(cache_latents_to_disk=True, disk_cache_dir=tmp_path / "latents", random_flip=True)
    encodes: list[int] = []
    real_encode = AutoencoderKL.encode
    monkeypatch.setattr(AutoencoderKL, "encode",
                        lambda self, *a, **kw: encodes.append(1) or real_encode(self, *a, **kw))
    steps: list[int] = []
    outcome = train(_cfg(tmp_path, "a", max_train_steps=2, **disk), tiny_sd, data, None, tmp_path / "a",
                    callbacks=[lambda entry: steps.append(len(encodes))])
    assert len(_entries(tmp_path / "latents")) == 6, "both flips of all 3 images, before the first step"
    assert steps == [6, 6], "no encoding inside a step"
    assert outcome.report()["latent_cache_seconds"] > 0
