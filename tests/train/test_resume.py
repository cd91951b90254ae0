"""Never lose progress: exact resume, a checkpoint on exception, NaN keeps the last good one."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tasks.train.checkpoints import TrainState
from tasks.train.config import TrainConfig
from tasks.train.core import train
from tasks.train.ema import Ema
from tasks.train.loop import TrainingDiverged
from tasks.train.methods.dreambooth import DreamBooth

UNET = "unet/diffusion_pytorch_model.safetensors"


class Stop(Exception):
    pass


def test_ten_steps_equal_five_plus_resume_plus_five(tmp_path, tiny_sd, instance_dir, class_dir) -> None:
    """Prior preservation, random flips, accumulation, a decaying LR, EMA and the caches: resuming
    restores weights, optimizer, schedule, EMA, RNGs and the data position, so the weights match."""
    kw = dict(max_train_steps=10, train_batch_size=1, resolution=32, num_validation_images=1,
              validation_inference_steps=2, learning_rate=1e-3, random_flip=True, gradient_accumulation_steps=2,
              lr_scheduler="linear", use_ema=True, ema_decay=0.9, checkpointing_steps=2, checkpoints_total_limit=1)
    straight = train(TrainConfig(**kw, checkpoints_dir=tmp_path / "a", resume="none", keep_checkpoints_every_steps=4),
                     tiny_sd, instance_dir, class_dir, tmp_path / "straight")
    assert sorted(p.name for p in straight.checkpoint_dir.glob("checkpoint-*")) == [
        "checkpoint-10", "checkpoint-4", "checkpoint-8"], "the newest, and every 4th step's for good"

    def stop_after_five(entry) -> None:
        if entry.step == 5:
            raise Stop("an error inside the loop")

    interrupted = TrainConfig(**{**kw, "checkpointing_steps": 100}, checkpoints_dir=tmp_path / "b", resume="latest",
                              validation_steps=2)
    with pytest.raises(Stop):
        train(interrupted, tiny_sd, instance_dir, class_dir, tmp_path / "resumed", callbacks=[stop_after_five])
    run_dir = next((tmp_path / "b").iterdir())
    assert sorted(p.name for p in run_dir.glob("checkpoint-*")) == ["checkpoint-5"], "saved on the exception"
    saved = load_file(run_dir / "checkpoint-5" / "trainable_unet.safetensors")
    assert set(saved) == set(load_file(tiny_sd / UNET)), "every UNet weight trains in DreamBooth"

    resumed = train(interrupted, tiny_sd, instance_dir, class_dir, tmp_path / "resumed")
    assert resumed.resumed_from == 5 and [h.step for h in resumed.history] == [6, 7, 8, 9, 10]
    assert [h[1] for h in resumed.losses] == pytest.approx([h[1] for h in straight.losses], rel=1e-6)
    a, b = load_file(tmp_path / "straight" / UNET), load_file(tmp_path / "resumed" / UNET)
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a), "same weights (validation in between or not)"
    assert resumed.report()["steps"] == 10 and resumed.report()["resumed_from_step"] == 5


def test_nan_stops_and_keeps_the_last_good_checkpoint(tmp_path, tiny_sd, instance_dir, monkeypatch) -> None:
    def poison_after_step_two(self: DreamBooth) -> None:  # a fault injected where a real divergence would act
        self.steps = getattr(self, "steps", 0) + 1
        if self.steps == 2:
            with torch.no_grad():
                self.components.denoiser.conv_out.weight.fill_(float("nan"))

    monkeypatch.setattr(DreamBooth, "after_step", poison_after_step_two)
    config = TrainConfig(max_train_steps=5, train_batch_size=1, resolution=32, num_validation_images=0,
                         with_prior_preservation=False, checkpointing_steps=1, checkpoints_total_limit=3,
                         checkpoints_dir=tmp_path / "ckpt")
    with pytest.raises(TrainingDiverged, match=r"weights became nan at step 2.*learning_rate.*checkpoint-1"):
        train(config, tiny_sd, instance_dir, None, tmp_path / "out")
    run_dir = next((tmp_path / "ckpt").iterdir())
    assert sorted(p.name for p in run_dir.glob("checkpoint-*")) == ["checkpoint-1"], "step 2 was not saved"
    assert not (tmp_path / "out").exists()


def test_ema_on_the_cpu_tracks_and_round_trips() -> None:
    layer = torch.nn.Linear(3, 3)
    params = list(layer.parameters())
    ema = Ema(params, TrainConfig(use_ema=True, ema_decay=0.5, offload_ema=True, ema_update_every=2))
    start = [p.detach().clone() for p in params]

    def shadow_is(offset: float) -> bool:
        shadow = ema.state_dict()["shadow_params"]
        return all(s.device.type == "cpu" and torch.allclose(s, a + offset) for s, a in zip(shadow, start))

    for step in (1, 2):
        with torch.no_grad():
            for p in params:
                p.add_(1.0)
        ema.step(2 * step - 1)
        assert shadow_is(0.0 if step == 1 else 1.0), "no update on odd steps (ema_update_every 2)"
        ema.step(2 * step)
    # diffusers' EMAModel: the first update copies, then decay min((1+n)/(10+n), ema_decay) with n = 1
    assert shadow_is(1.0 + (1 - 2 / 11))
    with ema.swapped_in():
        assert torch.allclose(params[0], start[0] + 1.0 + 9 / 11)
    assert torch.allclose(params[0], start[0] + 2.0), "the trained weights come back"
    clone = Ema(params, TrainConfig(use_ema=True))
    clone.load_state_dict(ema.state_dict())
    assert clone.model.optimization_step == 2 and math.isclose(clone.model.decay, 0.5)


def test_train_state_round_trips() -> None:
    state = TrainState(step=3, epoch=1, batches_in_epoch=2, images=12, history=[[1, 0.5, 1e-4]])
    other = TrainState()
    other.load_state_dict(state.state_dict())
    assert other == state


def test_resume_from_an_explicit_folder_that_is_not_a_checkpoint(tmp_path, tiny_sd, instance_dir) -> None:
    from tasks.common.errors import UserError

    (tmp_path / "checkpoint-3").mkdir()
    config = TrainConfig(resume=str(tmp_path / "checkpoint-3"), with_prior_preservation=False,
                         checkpoints_dir=tmp_path / "ckpt", num_validation_images=0, resolution=32)
    with pytest.raises(UserError, match="checkpoint-3 has no manifest.json.*not trusted.*resume: none"):
        train(config, tiny_sd, instance_dir, None, tmp_path / "out")
    assert Path(config.resume).is_dir()
