"""Stage `train`: DreamBooth on the tiny models through the shared loop; outputs load in diffusers."""
from __future__ import annotations

import csv
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from tasks.common.config import parse_section
from tasks.common.errors import UserError
from tasks.train.config import TrainConfig
from tasks.train.core import train
from tasks.train.loop import TrainingDiverged
from tests.conftest import REPO, stage_runs

UNET = "unet/diffusion_pytorch_model.safetensors"
TEXT = "text_encoder/model.safetensors"
FAST = dict(max_train_steps=3, train_batch_size=1, num_validation_images=0, learning_rate=1e-3)


def cfg(**kw) -> TrainConfig:
    return TrainConfig(**{**FAST, **kw})


def tensors_equal(a: Path, b: Path) -> bool:
    ta, tb = load_file(a), load_file(b)
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def test_dreambooth_trains_and_saves_a_loadable_pipeline(tmp_path, tiny_sd, instance_dir, class_dir) -> None:
    from diffusers import DiffusionPipeline

    out = tmp_path / "finetuned"
    outcome = train(cfg(), tiny_sd, instance_dir, class_dir, out)
    assert [h.step for h in outcome.history] == [1, 2, 3]
    assert all(math.isfinite(h.loss) and h.loss > 0 for h in outcome.history)
    assert all(set(h.extra) == {"instance_loss", "prior_loss"} for h in outcome.history)
    assert outcome.images == 3 * 2, "one instance + one class image per step"
    pipe = DiffusionPipeline.from_pretrained(out)
    assert type(pipe).__name__ == "StableDiffusionPipeline"
    assert not tensors_equal(out / UNET, tiny_sd / UNET), "the UNet must have been trained"
    assert tensors_equal(out / TEXT, tiny_sd / TEXT), "the text encoder is frozen by default"
    report = outcome.report()
    assert report["steps"] == 3 and report["family"] == "sd" and report["final_loss"] == outcome.history[-1].loss
    assert set(report["weights_sha256"]) == {UNET, TEXT, "vae/diffusion_pytorch_model.safetensors"}
    assert not list(tmp_path.glob(".finetuned*")), "no temporary folder is left behind"


def test_same_seed_same_weights_other_seed_other_weights(tmp_path, tiny_sd, instance_dir, class_dir) -> None:
    a = train(cfg(max_train_steps=2), tiny_sd, instance_dir, class_dir, tmp_path / "a")
    b = train(cfg(max_train_steps=2), tiny_sd, instance_dir, class_dir, tmp_path / "b")
    c = train(cfg(max_train_steps=2, seed=1), tiny_sd, instance_dir, class_dir, tmp_path / "c")
    assert a.weights == b.weights and [h.loss for h in a.history] == [h.loss for h in b.history]
    assert a.weights[UNET] != c.weights[UNET]


def test_text_encoder_training_and_v_prediction(tmp_path, tiny_sd, instance_dir, class_dir) -> None:
    from diffusers import DiffusionPipeline

    out = tmp_path / "out"
    train(cfg(max_train_steps=2, train_text_encoder=True, prediction_type="v_prediction"),
          tiny_sd, instance_dir, class_dir, out)
    assert not tensors_equal(out / TEXT, tiny_sd / TEXT)
    assert DiffusionPipeline.from_pretrained(out).scheduler.config.prediction_type == "v_prediction"


def test_sdxl_trains_in_the_same_loop(tmp_path, tiny_sdxl, instance_dir, class_dir) -> None:
    from diffusers import DiffusionPipeline

    out = tmp_path / "out"
    outcome = train(cfg(max_train_steps=2, train_text_encoder=True), tiny_sdxl, instance_dir, class_dir, out)
    assert outcome.family == "sdxl" and all(math.isfinite(h.loss) for h in outcome.history)
    assert type(DiffusionPipeline.from_pretrained(out)).__name__ == "StableDiffusionXLPipeline"
    for name in (UNET, TEXT, "text_encoder_2/model.safetensors"):
        assert not tensors_equal(out / name, tiny_sdxl / name), name


def test_bf16_accumulation_and_no_prior(tmp_path, tiny_sd, instance_dir) -> None:
    outcome = train(
        cfg(max_train_steps=2, mixed_precision="bf16", gradient_accumulation_steps=2, with_prior_preservation=False,
            gradient_checkpointing=True, random_flip=True, center_crop=False,
            lr_scheduler="linear", lr_warmup_steps=1),
        tiny_sd, instance_dir, None, tmp_path / "out",
    )
    # 3 instance images, batch 1, 2 micro-batches per step: step 2 gets the epoch's last
    # micro-batch alone (accelerate syncs gradients at the end of the dataloader).
    assert [h.step for h in outcome.history] == [1, 2] and outcome.images == 3
    assert all(math.isfinite(h.loss) for h in outcome.history)
    assert outcome.history[0].lr == 0.0 and outcome.history[1].lr == pytest.approx(1e-3), "warm-up, then decay"
    assert set(outcome.history[0].extra) == {"instance_loss"}
    weights = load_file(tmp_path / "out" / UNET)
    assert all(t.dtype == torch.float32 for t in weights.values()), "saved in full precision"


def test_prior_preservation_without_class_images(tmp_path, tiny_sd, instance_dir) -> None:
    with pytest.raises(UserError, match="class_images"):
        train(cfg(), tiny_sd, instance_dir, tmp_path / "missing", tmp_path / "out")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metadata.jsonl").write_text("")
    with pytest.raises(UserError, match="with_prior_preservation: false"):
        train(cfg(), tiny_sd, instance_dir, tmp_path / "empty", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_missing_or_empty_instance_data(tmp_path, tiny_sd, class_dir) -> None:
    with pytest.raises(UserError, match="ingest"):
        train(cfg(), tiny_sd, tmp_path / "processed", class_dir, tmp_path / "out")
    (tmp_path / "processed").mkdir()
    (tmp_path / "processed" / "metadata.jsonl").write_text('{"file_name": "gone.png", "text": "x"}\n')
    with pytest.raises(UserError, match="gone.png"):
        train(cfg(), tiny_sd, tmp_path / "processed", class_dir, tmp_path / "out")


def test_nan_loss_stops_with_a_message(tmp_path, tiny_sd, instance_dir, class_dir) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(tiny_sd, broken)
    weights = load_file(broken / UNET)
    name = next(k for k in weights if k.endswith("conv_out.weight"))
    weights[name] = torch.full_like(weights[name], float("nan"))
    save_file(weights, broken / UNET)
    with pytest.raises(TrainingDiverged, match=r"loss became nan at step 1.*learning_rate"):
        train(cfg(), broken, instance_dir, class_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_config_checks_and_frozen_surface() -> None:
    with pytest.raises(UserError, match=r"train\.learning_rate"):
        parse_section("train", {"learning_rate": -1}, TrainConfig)
    with pytest.raises(UserError, match=r"train\.max_train_step: unknown key"):
        parse_section("train", {"max_train_step": 3}, TrainConfig)
    with pytest.raises(UserError, match="lr_warmup_steps"):
        parse_section("train", {"max_train_steps": 2, "lr_warmup_steps": 5}, TrainConfig)
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="fp16 needs a CUDA GPU"):
            parse_section("train", {"mixed_precision": "fp16"}, TrainConfig)
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    parse_section("train", params["train"], TrainConfig)  # the shipped section is valid
    # New options are a decision: adding one means updating this list (and params.yaml/README).
    assert sorted(TrainConfig.model_fields) == sorted([
        "method", "instance_prompt", "class_prompt", "with_prior_preservation", "prior_loss_weight",
        "train_text_encoder", "resolution", "center_crop", "random_flip", "train_batch_size",
        "dataloader_num_workers", "max_train_steps", "gradient_accumulation_steps", "gradient_checkpointing",
        "learning_rate", "lr_scheduler", "lr_warmup_steps", "adam_beta1", "adam_beta2", "adam_weight_decay",
        "adam_epsilon", "max_grad_norm", "mixed_precision", "prediction_type", "validation_prompt",
        "num_validation_images", "validation_inference_steps", "log_every_steps", "seed",
    ])


def test_cli_writes_outputs_and_logs_loss_history(tmp_path, tiny_sd, instance_dir, class_dir, isolated_mlflow) -> None:
    from mlflow.tracking import MlflowClient

    params = tmp_path / "params.yaml"
    section = {**FAST, "max_train_steps": 4, "log_every_steps": 2, "num_validation_images": 2,
               "validation_inference_steps": 2}
    params.write_text(yaml.safe_dump({"train": section}))
    out, report, plot = tmp_path / "models" / "finetuned", tmp_path / "reports" / "train.json", tmp_path / "reports" / "train_loss.csv"
    done = subprocess.run(
        [sys.executable, "-m", "tasks.train", "--base", str(tiny_sd), "--data", str(instance_dir),
         "--class-data", str(class_dir), "--out", str(out), "--report", str(report), "--plot", str(plot),
         "--params", str(params)],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert (out / "model_index.json").is_file() and (out / UNET).is_file()
    data = json.loads(report.read_text())
    assert data["steps"] == 4 and math.isfinite(data["final_loss"]) and data["images_per_second"] > 0
    with open(plot, newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["step"] for r in rows] == ["1", "2", "3", "4"] and set(rows[0]) == {"step", "loss", "lr"}
    assert float(rows[-1]["loss"]) == pytest.approx(data["final_loss"], rel=1e-5)

    runs = stage_runs(isolated_mlflow)
    assert [r.data.tags["stage"] for r in runs] == ["train"] and runs[0].info.status == "FINISHED"
    client = MlflowClient(tracking_uri=isolated_mlflow)
    history = client.get_metric_history(runs[0].info.run_id, "loss")
    assert sorted(m.step for m in history) == [2, 4], "throttled to every log_every_steps"
    assert runs[0].data.params["instance_prompt"] == "a photo of sks toy"
    artifacts = {a.path for a in client.list_artifacts(runs[0].info.run_id)}
    assert {"train.json", "train_loss.csv", "validation_grid.png"} <= artifacts

