"""Evaluate on a video fine-tune trained as image-to-video (train.first_frame_conditioning_p > 0): the tiny
LTX-Video, a LoRA trained two steps with every clip conditioned on its first frame, evaluated through the CLI
on the demo clips; the image-to-video clips start from the subject clips' first frames."""
from __future__ import annotations

import csv
import json
import math
import shutil
import sys

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from tasks.common.errors import UserError
from tasks.evaluate.config import EvaluateConfig, following_train_i2v
from tests.conftest import REPO

SECTION = {"prompts": ["a {identifier} {class_name} dancing"], "images_per_prompt": 1, "num_inference_steps": 2,
           "resolution": 64, "drift": {"enabled": False}, "seed": 3,
           "image_to_video": {"max_clips": 2}, "gate": {"min_gain_i2v_dino": -2.0, "min_i2v_clip_i": 2 ** -20}}


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """One intra-op thread (a 2-core machine shared with other work: more threads only spin)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """The tiny LTX-Video, the demo clips ingested at 64 px, a LoRA trained as image-to-video."""
    from tasks.common.families import build_tiny_pipeline
    from tasks.train.config import TrainConfig
    from tasks.train.core import train
    from tests.ingest.util import config, run

    tmp = tmp_path_factory.mktemp("i2v")
    base = build_tiny_pipeline("builtin:tiny-ltx", 0, tmp / "tiny-ltx")
    clips = tmp / "processed"
    run(config([{"type": "clips", "path": str(REPO / "data" / "demo" / "clips")}], video={"resolution": 64}), clips)
    cfg = TrainConfig(method="lora", max_train_steps=2, train_batch_size=2, resolution=64, num_validation_images=0,
                      with_prior_preservation=False, caption_column="text", first_frame_conditioning_p=1.0,
                      checkpoints_dir=tmp / "ckpt", checkpointing_steps=1000)
    train(cfg, base, clips, None, tmp / "lora")
    return {"base": base, "clips": clips, "lora": tmp / "lora", "tmp": tmp}


@pytest.fixture(scope="module")
def run(made, migrated_mlflow_db):
    """One CLI run (train.first_frame_conditioning_p 0.5 in its params.yaml: image_to_video follows it), with
    every VAE encode and decode of the run seen (the real methods run): an image-to-video call is the one
    decode that follows an encode (the text-to-video pipeline never encodes)."""
    from diffusers import AutoencoderKLLTXVideo

    from tasks.evaluate.__main__ import main
    from tests.conftest import reset_mlflow_globals

    work = made["tmp"] / "evaluate"
    work.mkdir()
    params = work / "params.yaml"
    section = {**SECTION, "base_cache_dir": str(work / "cache")}
    params.write_text(yaml.safe_dump({"train": {"first_frame_conditioning_p": 0.5}, "evaluate": section}))
    out, report = work / "plots", work / "evaluate.json"
    argv = ["python -m tasks.evaluate", "--model", str(made["lora"]), "--base", str(made["base"]),
            "--instance-data", str(made["clips"]), "--out", str(out), "--report", str(report),
            "--params", str(params), "--metrics", str(work / "metrics.json")]
    shutil.copy(migrated_mlflow_db, work / "mlflow.db")
    seen: list[tuple[str, torch.Tensor]] = []
    encode, decode = AutoencoderKLLTXVideo.encode, AutoencoderKLLTXVideo.decode

    def seen_encode(self, x, *args, **kwargs):
        seen.append(("encode", x.detach().clone()))
        return encode(self, x, *args, **kwargs)

    def seen_decode(self, z, *args, **kwargs):
        seen.append(("decode", z.detach().clone()))
        return decode(self, z, *args, **kwargs)

    mp = pytest.MonkeyPatch()
    mp.setattr(sys, "argv", argv)
    mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{work / 'mlflow.db'}")
    mp.setattr(AutoencoderKLLTXVideo, "encode", seen_encode)
    mp.setattr(AutoencoderKLLTXVideo, "decode", seen_decode)
    reset_mlflow_globals()
    try:
        main()
    finally:
        reset_mlflow_globals()
        mp.undo()
        reset_mlflow_globals()
    i2v = [(seen[k][1], seen[k + 1][1]) for k in range(len(seen) - 1)
           if seen[k][0] == "encode" and seen[k + 1][0] == "decode"]
    return {"out": out, "report": json.loads(report.read_text()), "seen": seen, "i2v": i2v,
            "metrics": json.loads((work / "metrics.json").read_text()), "section": section}


def _rows(made) -> list[dict]:
    return [json.loads(line) for line in (made["clips"] / "clips.jsonl").read_text().splitlines()]


def test_i2v_clips_start_from_the_subject_clips_first_frames(run, made) -> None:
    """Each image-to-video call encodes the first frame of a subject clip (clips.jsonl order, fine-tune then
    base), and the clip it decodes keeps that frame's latent sample, drawn from the seed's generator, as its
    first latent frame (LTXImageToVideoPipeline's guarantee: frame 0 never steps), the same for both models;
    the later frames are the models' own."""
    from diffusers import AutoencoderKLLTXVideo

    rows = _rows(made)[:2]
    assert len(run["i2v"]) == 4 and sum(1 for what, _ in run["seen"] if what == "encode") == 4
    vae = AutoencoderKLLTXVideo.from_pretrained(made["base"] / "vae")
    decoded = []
    for k, (given, latents) in enumerate(run["i2v"]):
        row = rows[k % 2]
        with Image.open(made["clips"] / row["file_name"] / row["frame_files"][0]) as first:
            pixels = torch.from_numpy(np.asarray(first.convert("RGB"), dtype=np.float32) / 127.5 - 1.0)
        assert given.shape == (1, 3, 1, 64, 64)
        torch.testing.assert_close(given[0, :, 0], pixels.permute(2, 0, 1), atol=1e-6, rtol=0)
        with torch.no_grad():
            sample = vae.encode(given).latent_dist.sample(generator=torch.Generator().manual_seed(SECTION["seed"]))
        assert latents.shape == (1, 8, 2, 2, 2)  # 9 frames / 8 + 1, 64 px / 32
        torch.testing.assert_close(latents[:, :, :1], sample, atol=1e-5, rtol=1e-5)
        decoded.append(latents)
    for tuned, based in zip(decoded[:2], decoded[2:], strict=True):
        assert torch.equal(tuned[:, :, 0], based[:, :, 0])
        assert not torch.equal(tuned[:, :, 1:], based[:, :, 1:])  # the LoRA moved the frames it made
    text_to_video = [z for what, z in run["seen"] if what == "decode" and not any(z is d for d in decoded)]
    assert text_to_video and all(not torch.allclose(z[:, :, :1], decoded[0][:, :, :1]) for z in text_to_video)


def test_the_report_scores_the_i2v_clips_beside_the_base(run, made) -> None:
    """i2v_* (CLIP-T, CLIP-I, DINO, temporal consistency) finite and in range, the base's and the gains
    (fine-tune minus base), the gate's two i2v checks, the protocol naming the clips; the per-clip rows
    average to the metrics."""
    report, metrics = run["report"], run["report"]["metrics"]
    names = ("clip_t", "clip_i", "dino", "temporal_consistency")
    for name in names:
        tuned, base = metrics[f"i2v_{name}"], metrics[f"base_i2v_{name}"]
        assert math.isfinite(tuned) and math.isfinite(base) and -1.0 <= tuned <= 1.0, (name, tuned, base)
        assert metrics[f"gain_i2v_{name}"] == pytest.approx(tuned - base, abs=2e-6)
        assert run["metrics"][f"i2v_{name}"] == tuned
    assert metrics["i2v_temporal_consistency"] < 1.0  # the frames move
    rows = _rows(made)
    section = report["image_to_video"]
    assert section["clips"] == [r["file_name"] for r in rows[:2]]
    assert section["prompts"] == [r["text"] for r in rows[:2]]
    for name in names:
        assert np.mean([r[name] for r in section["rows"]]) == pytest.approx(metrics[f"i2v_{name}"], abs=1e-5)
    assert section["rows"][0]["clip_t_text"] == rows[0]["text"].replace("sks ", "")
    checks = report["gate"]["checks"]
    assert set(checks) == {"gain_i2v_dino", "i2v_clip_i"} and report["gate"]["passed"]
    assert checks["i2v_clip_i"]["value"] == metrics["i2v_clip_i"]
    assert report["protocol"]["settings"]["image_to_video"]["clips"] == 2
    assert metrics["clip_t"] != metrics["i2v_clip_t"]  # scored against the captions, not the prompts


def test_the_plots_hold_the_i2v_clips(run) -> None:
    """grid_i2v.png and grid_i2v_base.png (a row per subject clip, a 9-frame filmstrip each), the fine-tune's
    first clip as preview_i2v.gif, per_i2v.csv with a row per clip; the two grids differ (the LoRA)."""
    out = run["out"]
    with Image.open(out / "grid_i2v.png") as grid, Image.open(out / "grid_i2v_base.png") as base:
        assert grid.size == base.size == (9 * 64, 2 * 64)
        tuned_pixels, base_pixels = np.asarray(grid.convert("RGB")), np.asarray(base.convert("RGB"))
    assert not np.array_equal(tuned_pixels, base_pixels)
    with Image.open(out / "preview_i2v.gif") as gif:
        assert gif.n_frames == 9 and gif.size == (64, 64)
    with open(out / "per_i2v.csv", newline="") as fh:
        table = list(csv.DictReader(fh))
    assert len(table) == 2 and float(table[0]["dino"]) == run["report"]["image_to_video"]["rows"][0]["dino"]
    assert (out / "grid.png").is_file() and (out / "preview.gif").is_file()  # the text-to-video ones still


def test_the_base_image_cache_keeps_the_base_i2v_clips(run, made) -> None:
    """A second evaluation of the same fine-tune reads the base's clips, image-to-video ones included, from
    the cache the CLI run filled: its base_i2v_* scores are the CLI run's, bit for bit through PNG."""
    from tasks.evaluate.core import evaluate

    assert run["report"]["generation"]["base_cache"] == "miss"
    cfg = EvaluateConfig(**{**run["section"], "image_to_video": {"enabled": True, "max_clips": 2}})
    again = evaluate(made["lora"], made["base"], made["clips"], cfg)
    assert again.report["generation"]["base_cache"] == "hit"
    first = run["report"]["metrics"]
    assert {k: v for k, v in again.report["metrics"].items() if "i2v" in k} == {k: v for k, v in first.items()
                                                                               if "i2v" in k}
    assert again.report["protocol"]["id"] == run["report"]["protocol"]["id"]


def test_image_to_video_follows_train_first_frame_conditioning_p() -> None:
    """Null follows train.first_frame_conditioning_p > 0 (0 and an absent key: off); a set value stays; a
    value that is not a number is named with both keys."""
    cfg = EvaluateConfig(prompts=["a {class_name}"])
    assert following_train_i2v(cfg, {"train": {"first_frame_conditioning_p": 0.25}}).image_to_video.enabled is True
    assert following_train_i2v(cfg, {"train": {"first_frame_conditioning_p": 0.0}}).image_to_video.enabled is False
    assert following_train_i2v(cfg, {}).image_to_video.enabled is False
    off = cfg.model_copy(update={"image_to_video": cfg.image_to_video.model_copy(update={"enabled": False})})
    assert following_train_i2v(off, {"train": {"first_frame_conditioning_p": 1.0}}).image_to_video.enabled is False
    with pytest.raises(UserError, match=r"evaluate.image_to_video.enabled is null, so it follows "
                                        r"train.first_frame_conditioning_p, which must be a number .* not 'half'"):
        following_train_i2v(cfg, {"train": {"first_frame_conditioning_p": "half"}})
    with pytest.raises(ValueError, match=r"gate.min_i2v_dino needs image_to_video.enabled: true or null"):
        EvaluateConfig(prompts=["a"], gate={"min_i2v_dino": 0.5}, image_to_video={"enabled": False})
    with pytest.raises(ValueError, match=r"gate.min_gain_i2v_dino needs compare_base: true"):
        EvaluateConfig(prompts=["a"], gate={"min_gain_i2v_dino": 0.0}, compare_base=False)


def test_what_cannot_make_image_to_video_clips_is_refused_before_any_pipeline_loads(made, tmp_path) -> None:
    """An i2v threshold when the model did not train as image-to-video; instance data without clips."""
    from tasks.evaluate.core import evaluate

    cfg = following_train_i2v(EvaluateConfig(**{**SECTION, "image_to_video": {}}), {})
    with pytest.raises(UserError, match=r"evaluate.gate.min_i2v_clip_i scores image-to-video clips, but "
                                        r"evaluate.image_to_video is off .*set evaluate.gate.min_i2v_clip_i: null"):
        evaluate(made["lora"], made["base"], made["clips"], cfg)
    images = tmp_path / "images"
    images.mkdir()
    Image.new("RGB", (64, 64), (200, 30, 30)).save(images / "a.png")
    cfg = EvaluateConfig(**{**SECTION, "image_to_video": {"enabled": True}})
    with pytest.raises(UserError, match=rf"{images} has no clips.jsonl .*set evaluate.image_to_video.enabled: false"):
        evaluate(made["lora"], made["base"], images, cfg)
