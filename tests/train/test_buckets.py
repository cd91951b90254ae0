"""Aspect-ratio buckets: the rule, the sampler, and training on portrait and landscape images whole."""
from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file

from tasks.common.errors import UserError
from tasks.common.families import detect
from tasks.train.buckets import BucketBatchSampler, kohya_buckets
from tasks.train.config import TrainConfig
from tasks.train.core import train

UNET = "unet/diffusion_pytorch_model.safetensors"
BUCKETS = dict(enable_bucket=True, min_bucket_reso=16, max_bucket_reso=64, bucket_reso_steps=8)


def test_kohya_rule_keeps_the_area_and_the_step() -> None:
    buckets = kohya_buckets(32, 16, 64, 8)
    assert (32, 32) in buckets and (40, 24) in buckets and (24, 40) in buckets
    assert all(h * w <= 32 * 32 and h % 8 == 0 and w % 8 == 0 and min(h, w) >= 16 for h, w in buckets)
    assert kohya_buckets(1024, 256, 2048, 64)[:2] == [(256, 2048), (320, 2048)]


def test_bucket_options_are_checked() -> None:
    assert TrainConfig(enable_bucket=True, resolution=32).bucket_shape() == (16, 64, 8)
    assert TrainConfig(enable_bucket=True, aspect_ratio_buckets="32,32; 40,24").buckets() == [(32, 32), (40, 24)]
    assert TrainConfig(enable_bucket=True, aspect_ratio_buckets=[[24, 40]]).buckets() == [(24, 40)]
    for bad, says in ((dict(min_bucket_reso=16), "only matter with enable_bucket"),
                      (dict(enable_bucket=True, aspect_ratio_buckets="32x32"), "aspect_ratio_buckets"),
                      (dict(enable_bucket=True, aspect_ratio_buckets=[[30, 32]]), "multiples of 8"),
                      (dict(enable_bucket=True, resolution=64, max_bucket_reso=48), "<= max_bucket_reso")):
        with pytest.raises(ValidationError, match=says):
            TrainConfig(**bad)


def test_flow_families_refuse_buckets_their_latents_cannot_pack(tiny_flux) -> None:
    with pytest.raises(UserError, match="multiples of 16"):
        TrainConfig(**BUCKETS, resolution=32).check_family(detect(tiny_flux))
    TrainConfig(**{**BUCKETS, "bucket_reso_steps": 16}, resolution=32).check_family(detect(tiny_flux))


def test_sampler_batches_within_a_bucket_reproducibly() -> None:
    bucket_of = [0, 1, 1, 0, 2, 1, 1, 0, 1]
    sampler = BucketBatchSampler(bucket_of, 2, seed=3)
    epoch0 = list(sampler)
    assert len(epoch0) == len(sampler) == 2 + 3 + 1, "the last batch of a bucket may be smaller"
    assert all(len({bucket_of[i] for _, i in batch}) == 1 for batch in epoch0)
    assert sorted(i for batch in epoch0 for _, i in batch) == list(range(9)), "each example once per epoch"
    assert epoch0 == list(BucketBatchSampler(bucket_of, 2, seed=3)), "a function of the seed"
    sampler.set_epoch(1)
    assert list(sampler) != epoch0 and all(e == 1 for batch in sampler for e, _ in batch)


def _spy_sdxl(monkeypatch) -> list[dict]:
    from tasks.common.families import sdxl

    seen: list[dict] = []
    original = sdxl.add_time_ids

    def spy(original_sizes, crops_top_left, resolution, target_sizes=None):
        ids = original(original_sizes, crops_top_left, resolution, target_sizes)
        seen.append({"time_ids": ids.tolist()})
        return ids

    monkeypatch.setattr(sdxl, "add_time_ids", spy)
    return seen


def test_portrait_and_landscape_train_whole_with_sdxl_conditioning(
        tmp_path, tiny_sdxl, mixed_dir, class_dir, monkeypatch) -> None:
    """Prior preservation: the class images (squares) are cropped to each batch's bucket."""
    from tasks.train.methods.base import TrainingMethod

    shapes: list[tuple[int, ...]] = []
    compute = TrainingMethod.compute_loss

    def spy_loss(self, batch, modules):
        shapes.append(tuple(batch.pixels.shape))
        return compute(self, batch, modules)

    monkeypatch.setattr(TrainingMethod, "compute_loss", spy_loss)
    seen = _spy_sdxl(monkeypatch)
    cfg = TrainConfig(**BUCKETS, resolution=32, train_batch_size=2, max_train_steps=4, num_validation_images=0,
                      checkpoints_dir=tmp_path / "ckpt", resume="none", system_metrics_interval=0)
    outcome = train(cfg, tiny_sdxl, mixed_dir, class_dir, tmp_path / "out")
    assert outcome.report()["buckets"] == {"24x40": 3, "32x32": 1, "40x24": 2}
    # one epoch: tall (2), wide (2 + 1), square (1); instance rows then class rows of the same bucket
    assert sorted(shapes) == sorted([(4, 3, 40, 24), (4, 3, 24, 40), (2, 3, 24, 40), (2, 3, 32, 32)])
    rows = sorted({tuple(r) for step in seen for r in step["time_ids"]})
    # (orig h, orig w, crop top, crop left, target h, target w): the whole 48x80 image scaled to 24x40
    assert (80, 48, 0, 0, 40, 24) in rows and (48, 80, 0, 0, 24, 40) in rows and (64, 64, 0, 0, 32, 32) in rows
    # a square class image (64x64) in a 40x24 bucket: scaled to 40x40, centre-cropped 8 px from the left
    assert (64, 64, 0, 8, 40, 24) in rows and (64, 64, 8, 0, 24, 40) in rows


def test_flux_trains_non_square_buckets(tmp_path, tiny_flux, mixed_dir) -> None:
    """FLUX packs 2x2 latent patches by the latents' own size: a fixed list of non-square buckets."""
    cfg = TrainConfig(enable_bucket=True, aspect_ratio_buckets="48,32;32,48;32,32", resolution=32, method="lora",
                      with_prior_preservation=False, max_sequence_length=16, train_batch_size=2, max_train_steps=3,
                      num_validation_images=0, checkpoints_dir=tmp_path / "ckpt", resume="none",
                      system_metrics_interval=0)
    outcome = train(cfg, tiny_flux, mixed_dir, None, tmp_path / "out")
    assert outcome.report()["buckets"] == {"48x32": 2, "32x48": 3, "32x32": 1}
    assert all(math.isfinite(h[1]) for h in outcome.losses) and outcome.report()["steps"] == 3


def test_exact_resume_with_buckets(tmp_path, tiny_sd, mixed_dir, class_dir) -> None:
    kw = dict(**BUCKETS, max_train_steps=6, train_batch_size=2, resolution=32, num_validation_images=0,
              learning_rate=1e-3, random_flip=True, lr_scheduler="linear", checkpointing_steps=100,
              system_metrics_interval=0)
    straight = train(TrainConfig(**kw, checkpoints_dir=tmp_path / "a", resume="none"),
                     tiny_sd, mixed_dir, class_dir, tmp_path / "straight")

    class Stop(Exception):
        pass

    def stop_after_three(entry) -> None:
        if entry.step == 3:  # mid-epoch: 4 batches of buckets per epoch
            raise Stop

    cfg = TrainConfig(**kw, checkpoints_dir=tmp_path / "b", resume="latest")
    with pytest.raises(Stop):
        train(cfg, tiny_sd, mixed_dir, class_dir, tmp_path / "resumed", callbacks=[stop_after_three])
    resumed = train(cfg, tiny_sd, mixed_dir, class_dir, tmp_path / "resumed")
    assert resumed.resumed_from == 3
    assert [h[1] for h in resumed.losses] == pytest.approx([h[1] for h in straight.losses], rel=1e-6)
    a, b = load_file(tmp_path / "straight" / UNET), load_file(tmp_path / "resumed" / UNET)
    assert all(torch.equal(a[k], b[k]) for k in a), "bit-identical weights"


@pytest.mark.parametrize("method, extra", [
    ("textual_inversion", dict(placeholder_token="<sks>", initializer_token="toy", instance_prompt="a photo of <sks>")),
    ("full", dict(caption_column="text")),
    ("lora", {}),
])
def test_every_method_trains_on_buckets(tmp_path, tiny_sd, mixed_dir, method, extra) -> None:
    cfg = TrainConfig(**BUCKETS, **extra, method=method, with_prior_preservation=False, resolution=32,
                      train_batch_size=2, max_train_steps=4, num_validation_images=0, system_metrics_interval=0,
                      checkpoints_dir=tmp_path / "ckpt", resume="none")
    outcome = train(cfg, tiny_sd, mixed_dir, None, tmp_path / "out")
    assert outcome.report()["steps"] == 4 and all(math.isfinite(h[1]) for h in outcome.losses)
    assert outcome.report()["buckets"] == {"24x40": 3, "32x32": 1, "40x24": 2}


def test_buckets_over_square_images_and_tag_shuffling_without_tags_are_refused(tmp_path, monkeypatch, tiny_sd,
                                                                                 instance_dir) -> None:
    """Settings the data makes moot fail before any weights load, naming the setting that matters."""
    import tasks.train.core as core
    from tests.train.conftest import write_imagefolder

    monkeypatch.setattr(core, "load_components", lambda *a, **k: pytest.fail("weights loaded before the check"))
    square = write_imagefolder(tmp_path / "square", 3, "a photo of sks toy", 5)
    base = dict(resolution=32, with_prior_preservation=False, num_validation_images=0, resume="none",
                checkpoints_dir=tmp_path / "ck")
    with pytest.raises(UserError, match=r"enable_bucket is true, but all 3 instance images are square.*"
                                        r"ingest.output_size: short_side"):
        train(TrainConfig(**base, **BUCKETS), tiny_sd, square, None, tmp_path / "out")
    with pytest.raises(UserError, match=r"shuffle_tag_p is set, but the prompts are not the images' captions"):
        train(TrainConfig(**base, shuffle_tag_p=0.5), tiny_sd, instance_dir, None, tmp_path / "out")
    with pytest.raises(UserError, match=r"shuffle_tag_p is set, but no instance image has tags"):
        train(TrainConfig(**base, shuffle_tag_p=0.5, caption_column="text"), tiny_sd, instance_dir, None,
              tmp_path / "out")
    assert not (tmp_path / "out").exists()
