"""The checkpoint that is best, not the last: scores per checkpoint, the collapse guard, weights that never moved."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from tasks.common.errors import UserError
from tasks.train.config import TrainConfig
from tasks.train.core import train
from tasks.train.loop import TrainingDiverged
from tasks.train.methods.dreambooth import DreamBooth
from tasks.train.methods.lora import LoRA
from tasks.train.selection import (
    NEAR_BLACK_MEAN,
    NEAR_UNIFORM_STD,
    WeightsNeverMoved,
    best_record,
    collapse_reason,
    image_collapse,
)

UNET = "unet/diffusion_pytorch_model.safetensors"
#: Tiny SD, one image a step, two validation images of two denoising steps each: a few seconds a run.
TINY = dict(train_batch_size=1, resolution=32, num_validation_images=2, validation_inference_steps=2,
            with_prior_preservation=False, validation_steps=0, resume="none")


def _image(values: np.ndarray) -> Image.Image:
    return Image.fromarray(np.clip(values, 0, 255).astype(np.uint8), "RGB")


def test_collapse_thresholds_on_synthetic_images() -> None:
    rng = np.random.default_rng(0)
    noise = _image(rng.integers(0, 256, (32, 32, 3)))
    dark_texture = _image(rng.integers(0, 70, (32, 32, 3)))  # dark, but a picture: mean ~35, std ~20
    assert image_collapse(noise) is None and image_collapse(dark_texture) is None
    assert image_collapse(_image(np.full((32, 32, 3), NEAR_BLACK_MEAN - 1))) == "near-black"
    assert image_collapse(_image(np.full((32, 32, 3), 255.0))) == "near-uniform"
    grey = 128 + rng.normal(0, NEAR_UNIFORM_STD / 2, (32, 32, 3))
    assert image_collapse(_image(grey)) == "near-uniform"
    healthy = {"clip_t": 0.1, "clip_i": 0.9, "dino": 0.9}
    black = _image(np.zeros((32, 32, 3)))
    assert collapse_reason([noise, noise], 0.5, healthy) is None
    assert collapse_reason([noise, black], 0.5, healthy) == "1 of 2 validation images 1 near-black", "half is enough"
    assert collapse_reason([noise, noise, black], 0.5, healthy) is None, "one dark image in three is not collapse"
    assert collapse_reason([noise], float("nan"), healthy) == "loss nan"
    assert "non-finite dino" in collapse_reason([noise], 0.5, {**healthy, "dino": math.nan})


def test_best_record_follows_the_goal_and_skips_collapsed() -> None:
    records = [{"step": 2, "dino": 0.5, "collapsed": False}, {"step": 4, "dino": 0.9, "collapsed": False},
               {"step": 6, "dino": 0.1, "collapsed": True}, {"step": 8, "dino": 0.9, "collapsed": False}]
    assert best_record(records, "dino", "maximize")["step"] == 4, "the earliest of equals"
    assert best_record(records, "dino", "minimize")["step"] == 2, "never the collapsed one"
    assert best_record([records[2]], "dino", "maximize") is None


def test_scoring_follows_register_and_evaluate_unless_set() -> None:
    params = {"register": {"primary_metric": "gain_clip_i", "primary_metric_goal": "minimize"},
              "evaluate": {"identifier": "zwx", "clip_model": "builtin:tiny-clip", "encoder_seed": 3}}
    cfg = TrainConfig(select_checkpoint="best").with_scoring_from(params)
    scoring = cfg.checkpoint_scoring
    assert (scoring.metric, scoring.goal, scoring.identifier, scoring.encoder_seed) == ("gain_clip_i", "minimize",
                                                                                       "zwx", 3)
    assert scoring.scored_metric() == "clip_i", "gain_<m> ranks checkpoints as <m> does (the base is fixed)"
    own = TrainConfig(select_checkpoint="best", checkpoint_scoring={"metric": "clip_t"}).with_scoring_from(params)
    assert (own.checkpoint_scoring.metric, own.checkpoint_scoring.goal) == ("clip_t", "minimize")
    assert TrainConfig().with_scoring_from(None).checkpoint_scoring.metric == "dino", "the register's default"
    with pytest.raises(UserError, match="'drift_dino'.*cannot be scored on.*checkpoint_scoring.metric"):
        TrainConfig(select_checkpoint="best").with_scoring_from({"register": {"primary_metric": "drift_dino"}})
    with pytest.raises(ValueError, match="need validation images"):
        TrainConfig(select_checkpoint="best", num_validation_images=0)


def test_a_diverging_run_outputs_its_best_healthy_checkpoint(tmp_path, tiny_sd, instance_dir) -> None:
    """Learning rate 1: the loss becomes NaN after a few steps. `best` stops there and writes the best
    checkpoint scored before; `last` fails as before."""
    kw = dict(TINY, max_train_steps=12, learning_rate=1.0, checkpointing_steps=2, checkpoints_total_limit=1)
    outcome = train(TrainConfig(**kw, select_checkpoint="best", checkpoints_dir=tmp_path / "ck"), tiny_sd,
                    instance_dir, None, tmp_path / "out")
    report = outcome.report()
    selected = report["selected_checkpoint"]
    assert "loss became nan" in selected["stopped_early"]
    scored = {r["step"]: r for r in report["checkpoints"]}
    assert scored and max(scored) < 12 and all(math.isfinite(r["loss"]) for r in scored.values())
    assert all({"clip_t", "clip_i", "dino", "collapsed", "path"} <= set(r) for r in scored.values())
    best = max(scored.values(), key=lambda r: r["dino"])
    assert selected["step"] == best["step"] and not best["collapsed"] and selected["metric"] == "dino"
    saved = load_file(tmp_path / "out" / UNET)
    chosen = load_file(outcome.checkpoint_dir / f"checkpoint-{best['step']}" / "trainable_unet.safetensors")
    assert all(torch.equal(saved[k], chosen[k]) for k in chosen), "the output is the chosen checkpoint's weights"
    assert all(torch.isfinite(v).all() for v in saved.values())

    with pytest.raises(TrainingDiverged, match="loss became nan"):
        train(TrainConfig(**kw, checkpoints_dir=tmp_path / "last"), tiny_sd, instance_dir, None, tmp_path / "o2")
    assert not (tmp_path / "o2").exists()


def _black_samples_from_step(step: int, monkeypatch: pytest.MonkeyPatch, method: type = DreamBooth) -> None:
    """Late collapse: from `step` on the samples are black while the loss stays finite. The tiny model's
    random VAE decodes any latent to texture, so the fault is injected into its decoder (frozen, used
    only for images), where a collapsing model's output would show it."""

    def after_step(self: DreamBooth) -> None:
        self.steps = getattr(self, "steps", 0) + 1
        if self.steps == step:
            with torch.no_grad():
                self.components.vae.decoder.conv_out.bias.fill_(-1e3)

    monkeypatch.setattr(method, "after_step", after_step)


def test_collapsed_checkpoints_are_never_chosen(tmp_path, tiny_sd, instance_dir, monkeypatch) -> None:
    """Black images score the lowest DINO: with goal minimize they would win, were it not for the guard."""
    _black_samples_from_step(5, monkeypatch)
    kw = dict(TINY, max_train_steps=8, learning_rate=1e-3, checkpointing_steps=2, checkpoints_total_limit=1,
              checkpoint_scoring={"metric": "dino", "goal": "minimize"})
    outcome = train(TrainConfig(**kw, select_checkpoint="best", checkpoints_dir=tmp_path / "ck"), tiny_sd,
                    instance_dir, None, tmp_path / "out")
    scored = {r["step"]: r for r in outcome.report()["checkpoints"]}
    assert sorted(scored) == [2, 4, 6, 8]
    assert [scored[s]["collapsed"] for s in (2, 4, 6, 8)] == [False, False, True, True]
    assert "near-black" in scored[6]["collapse_reason"] and scored[6]["dino"] < min(scored[2]["dino"],
                                                                                     scored[4]["dino"])
    best = min((scored[2], scored[4]), key=lambda r: r["dino"])
    assert outcome.report()["selected_checkpoint"]["step"] == best["step"]
    kept = sorted(p.name for p in outcome.checkpoint_dir.glob("checkpoint-*"))
    assert kept == sorted({f"checkpoint-{best['step']}", "checkpoint-8"}), "the best is kept beyond the limit"
    assert [scored[s]["kept"] for s in (2, 4, 6, 8)] == [s in (best["step"], 8) for s in (2, 4, 6, 8)]

    with pytest.raises(UserError, match=rf"last step \(8\) collapsed.*near-black.*best healthy checkpoint is step "
                                        rf"{best['step']}.*select_checkpoint: best"):
        scored_last = {**kw, "checkpoint_scoring": {**kw["checkpoint_scoring"], "enabled": True}}
        train(TrainConfig(**scored_last, checkpoints_dir=tmp_path / "last"), tiny_sd, instance_dir, None,
              tmp_path / "o2")
    assert not (tmp_path / "o2").exists()


def test_lora_on_sdxl_writes_the_best_checkpoints_adapters(tmp_path, tiny_sdxl, instance_dir, monkeypatch) -> None:
    """The best checkpoint's adapters (not the last step's) go to --out, for LoRA on SDXL too."""
    _black_samples_from_step(3, monkeypatch, LoRA)
    cfg = TrainConfig(**TINY, method="lora", max_train_steps=4, learning_rate=1e-2, checkpointing_steps=2,
                      select_checkpoint="best", checkpoints_dir=tmp_path / "ck")
    outcome = train(cfg, tiny_sdxl, instance_dir, None, tmp_path / "out")
    assert [r["collapsed"] for r in outcome.report()["checkpoints"]] == [False, True]
    assert outcome.report()["selected_checkpoint"]["step"] == 2

    def sums(tensors: dict[str, torch.Tensor]) -> list[float]:
        return sorted(round(float(t.double().sum()), 5) for t in tensors.values())

    chosen = load_file(outcome.checkpoint_dir / "checkpoint-2" / "trainable_unet.safetensors")
    last = load_file(outcome.checkpoint_dir / "checkpoint-4" / "trainable_unet.safetensors")
    written = load_file(tmp_path / "out" / "pytorch_lora_weights.safetensors")
    assert sums(written) == sums(chosen) != sums(last)


def test_weights_that_never_moved_fail_the_stage(tmp_path, tiny_sd, instance_dir) -> None:
    """LoRA with a learning rate of 0 for the whole run (one step, still in its warm-up): adapters at init."""
    cfg = TrainConfig(**{**TINY, "num_validation_images": 0}, method="lora", max_train_steps=1,
                      lr_scheduler="constant_with_warmup", lr_warmup_steps=1, checkpoints_dir=tmp_path / "ck")
    with pytest.raises(WeightsNeverMoved, match=r"never moved.*after 1 step.*unchanged.*learning rate at the last "
                                                r"step 0.*train.learning_rate"):
        train(cfg, tiny_sd, instance_dir, None, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    moved = train(cfg.model_copy(update={"lr_warmup_steps": 0, "lr_scheduler": "constant"}), tiny_sd, instance_dir,
                  None, tmp_path / "out")
    assert moved.report()["steps"] == 1 and (tmp_path / "out").is_dir()


class Crash(Exception):
    pass


def test_a_crash_keeps_its_checkpoint_and_the_best(tmp_path, tiny_sd, instance_dir) -> None:
    """An exception after step 5 saves checkpoint-5; the best scored one survives the total limit; a resume
    still knows the scores from before the crash."""
    cfg = TrainConfig(**{**TINY, "resume": "latest"}, max_train_steps=6, learning_rate=1e-3, checkpointing_steps=2,
                      checkpoints_total_limit=1, select_checkpoint="best", checkpoints_dir=tmp_path / "ck")

    def crash(entry) -> None:
        if entry.step == 5:
            raise Crash("the loop failed")

    with pytest.raises(Crash):
        train(cfg, tiny_sd, instance_dir, None, tmp_path / "out", callbacks=[crash])
    run_dir = next((tmp_path / "ck").iterdir())
    kept = sorted(p.name for p in run_dir.glob("checkpoint-*"))
    assert "checkpoint-5" in kept and len(kept) == 2, f"the crash's checkpoint and the best of 2, 4: {kept}"
    resumed = train(cfg, tiny_sd, instance_dir, None, tmp_path / "out")
    assert resumed.resumed_from == 5
    assert [r["step"] for r in resumed.report()["checkpoints"]] == [2, 4, 6], "scores from before the crash kept"
