"""Options users expect, together: precision, accumulation, memory savers, augmentation, prior
preservation with trained text encoders, v-prediction, validation images during training."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tasks.train.config import TrainConfig
from tasks.train.core import train

UNET = "unet/diffusion_pytorch_model.safetensors"


def changed(out: Path, base: Path, name: str) -> bool:
    a, b = load_file(out / name), load_file(base / name)
    return any(not torch.equal(a[k], b[k]) for k in a)


def test_bf16_accumulation_and_memory_savers_on_sdxl(tmp_path, tiny_sdxl, instance_dir, class_dir) -> None:
    config = TrainConfig(
        max_train_steps=2, train_batch_size=1, resolution=32, num_validation_images=0, learning_rate=1e-3,
        mixed_precision="bf16", gradient_accumulation_steps=2, gradient_checkpointing=True, channels_last=True,
        center_crop=False, random_flip=True, noise_offset=0.1, lr_scheduler="linear", lr_warmup_steps=1,
        train_text_encoder=True, checkpoints_dir=tmp_path / "ckpt",
    )
    outcome = train(config, tiny_sdxl, instance_dir, class_dir, tmp_path / "out")
    assert [h.step for h in outcome.history] == [1, 2] and all(math.isfinite(h.loss) for h in outcome.history)
    assert outcome.images == 2 * 2 * 2, "2 steps x 2 micro-batches x (instance + class image)"
    assert outcome.history[0].lr == 0.0 and outcome.history[1].lr == pytest.approx(1e-3), "warm-up, then decay"
    assert set(outcome.history[0].extra) == {"instance_loss", "prior_loss"}
    assert all(h.peak_memory_mb > 0 and h.grad_norm > 0 for h in outcome.history)
    for name in (UNET, "text_encoder/model.safetensors", "text_encoder_2/model.safetensors"):
        assert changed(tmp_path / "out", tiny_sdxl, name), name
        assert all(t.dtype == torch.float32 for t in load_file(tmp_path / "out" / name).values()), "saved in fp32"


def test_v_prediction_text_encoder_and_validation_images(tmp_path, tiny_sd, instance_dir, class_dir) -> None:
    from diffusers import DiffusionPipeline

    config = TrainConfig(
        max_train_steps=2, train_batch_size=1, resolution=32, learning_rate=1e-3, prediction_type="v_prediction",
        train_text_encoder=True, validation_steps=1, num_validation_images=2, validation_inference_steps=2,
        validation_prompts=["a photo of sks toy", "a sks toy on the beach"], checkpoints_dir=tmp_path / "ckpt",
    )
    outcome = train(config, tiny_sd, instance_dir, class_dir, tmp_path / "out")
    assert changed(tmp_path / "out", tiny_sd, "text_encoder/model.safetensors")
    assert DiffusionPipeline.from_pretrained(tmp_path / "out").scheduler.config.prediction_type == "v_prediction"
    for entry in outcome.history:  # every step, from the live weights
        assert entry.validation is not None and set(entry.validation) == set(config.validation_prompts)
        assert all(len(v) == 2 and v[0].size == (32, 32) for v in entry.validation.values())
    assert set(outcome.validation) == set(config.validation_prompts), "and from the saved output"
