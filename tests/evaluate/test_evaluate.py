"""Evaluate end to end: a tiny exported model + the tiny base + a few drawn subject images."""
from __future__ import annotations

import csv
import json
import sys

import numpy as np
import pytest
import yaml
from PIL import Image

from tasks.common.config import load_config
from tasks.evaluate import metrics as M
from tasks.evaluate.config import EvaluateConfig
from tests.conftest import REPO
from tests.export.tiny_ov import exported, tiny_pipeline, write_subject_images

PROMPTS = [
    "a {identifier} {class_name} in the jungle",
    "a red {identifier} {class_name}",
    "a {class_name}",
]
SHAPE = {"batch_size": 2, "height": 64, "width": 64, "num_images_per_prompt": 1}


@pytest.fixture(scope="module")
def run(tmp_path_factory, migrated_mlflow_db):
    """One CLI run with the base fed in as the fine-tune (the right gains are exactly 0): 3 prompts
    x 1 image in PyTorch fp32 for both, and its export, fixed at 2 images per call (so the last
    call is padded), for the export fidelity; the gate has one threshold that holds and one that
    cannot."""
    import shutil

    from tasks.common.openvino_model import write_runtime_config
    from tasks.evaluate.__main__ import main

    _, shared, _ = exported(tmp_path_factory, "builtin:tiny-sd", **SHAPE)
    base = tiny_pipeline(tmp_path_factory, "builtin:tiny-sd")  # the export's own source: no gain
    work = tmp_path_factory.mktemp("evaluate")
    # f32 compute, as `export.inference_precision: f32` would record: the tiny model's images
    # hardly depend on the latents, so only exact numerics can show that base and fine-tuned
    # images start from the same latents (bf16 alone moves pixels about as much as other latents).
    model = work / "openvino"
    shutil.copytree(shared, model)
    write_runtime_config(model, "f32")
    data = write_subject_images(work / "data" / "processed")
    params = work / "params.yaml"
    section = {
        "prompts": PROMPTS,
        "images_per_prompt": 1,
        "num_inference_steps": 2,
        "gate": {"min_clip_i": -1.0, "min_dino": 0.999999},
    }
    params.write_text(yaml.safe_dump({"evaluate": section}))
    out, report = work / "reports" / "evaluate", work / "reports" / "evaluate.json"
    argv = [
        "python -m tasks.evaluate", "--model", str(base), "--export", str(model),
        "--base", str(base),
        "--instance-data", str(data), "--out", str(out), "--report", str(report),
        "--params", str(params), "--metrics", str(work / "reports" / "evaluate_metrics.json"),
    ]
    # The run gets an MLflow store of its own (the autouse per-test store would belong to whichever
    # test first asked for this module fixture); test_mlflow_run_has_metrics_and_artifacts reads it.
    from tests.conftest import reset_mlflow_globals

    shutil.copy(migrated_mlflow_db, work / "mlflow.db")
    uri = f"sqlite:///{work / 'mlflow.db'}"
    mp = pytest.MonkeyPatch()
    mp.setattr(sys, "argv", argv)
    mp.setenv("MLFLOW_TRACKING_URI", uri)
    reset_mlflow_globals()
    try:
        main()
    finally:
        reset_mlflow_globals()
        mp.undo()
        reset_mlflow_globals()
    return {"out": out, "report": json.loads(report.read_text()), "data": data, "model": model,
            "base": base,
            "flat": work / "reports" / "evaluate_metrics.json", "mlflow_uri": uri}


def test_report_has_metrics_gate_and_details(run):
    report = run["report"]
    metrics = report["metrics"]
    for name in ("clip_t", "clip_i", "dino", "base_clip_t", "base_clip_i", "base_dino",
                 "gain_clip_t", "gain_clip_i", "gain_dino", "real_clip_i", "real_dino"):
        assert isinstance(metrics[name], float), name
        assert -1.0 <= metrics[name] <= 1.0 or name.startswith("gain_")
    assert report["prompts"] == ["a sks toy in the jungle", "a red sks toy", "a toy"]
    expected = {"per_prompt": 1, "generated": 3, "instance": 4, "height": 64, "width": 64}
    assert report["images"] == expected
    # Fine-tune and base alike: PyTorch fp32, at the export's call shape.
    assert report["generation"]["backend"] == "pytorch"
    assert report["generation"]["precision"] == {"all": "f32"}
    assert report["generation"]["finetuned"] == {"method": "full_pipeline"}
    assert report["generation"]["call_shape"]["batch_size"] == 2
    assert report["generation"]["base_cache"] == "off"  # no evaluate.base_cache_dir in its params
    # each phase's peak RSS, one pipeline (or the encoders) at a time: tests/evaluate/test_real_size.py
    assert set(report["memory"]["peak_rss_mb"]) == {"export", "finetuned", "base", "score"}
    # The export's openvino_runtime.json asks for f32, and that is what ran (fidelity section).
    assert report["export_fidelity"]["backend"] == "openvino-static"
    assert report["export_fidelity"]["precision"] == {
        "text_encoder": "f32", "unet": "f32", "vae_decoder": "f32"}


def test_report_carries_the_protocol_its_scores_were_measured_under(run):
    protocol = run["report"]["protocol"]
    assert len(protocol["id"]) == 12 and protocol["calibrated"] is False
    assert protocol["uncalibrated_reason"].startswith(
        "uncalibrated scores: builtin:tiny-clip and builtin:tiny-dino have random (seeded) weights")
    settings = protocol["settings"]
    assert settings["clip"] == {"name": "builtin:tiny-clip", "seed": 0}
    assert settings["prompts"] == run["report"]["prompts"]
    assert settings["precision"] == run["report"]["generation"]["precision"]
    assert settings["backend"] == settings["base_backend"] == "pytorch"
    assert settings["precision"] == {"all": "f32"}
    assert settings["export_fidelity"] == {"max_prompts": None}
    assert (settings["seed"], settings["num_inference_steps"]) == (0, 2)


def test_a_no_op_fine_tune_fails_a_gate_that_asks_for_a_gain(run):
    """Controlled input: the 'fine-tune' is the base itself, so nothing was learned: on one backend
    and precision the gains are exactly 0, and a gate with a real gain threshold (README's for
    real encoders: min_gain_clip_i 0.02) fails it."""
    from tasks.evaluate.config import GateConfig

    metrics = run["report"]["metrics"]
    assert metrics["gain_dino"] == metrics["gain_clip_i"] == metrics["gain_clip_t"] == 0.0
    verdict = M.gate(metrics, GateConfig(min_gain_clip_i=0.02, min_gain_dino=0.02).model_dump())
    assert not verdict["passed"]
    assert not verdict["checks"]["gain_clip_i"]["passed"]
    assert not verdict["checks"]["gain_dino"]["passed"]


def test_gate_records_each_check_and_fails_when_one_fails(run):
    gate = run["report"]["gate"]
    assert gate["passed"] is False  # the registration step reads this key
    assert gate["checks"]["clip_i"]["passed"] is True
    dino = gate["checks"]["dino"]
    assert dino["min"] == 0.999999 and dino["passed"] is False and dino["value"] < 0.999999


def test_same_seeds_same_latents_for_finetuned_and_base(run):
    """The fine-tune is the base here: same latents per image, same backend, so the grids are
    equal bit for bit; the export (also through the padded static batch) matches them up to
    OpenVINO-vs-PyTorch numerics."""
    grid = np.asarray(Image.open(run["out"] / "grid.png"), dtype=np.float64)
    base = np.asarray(Image.open(run["out"] / "grid_base.png"), dtype=np.float64)
    export = np.asarray(Image.open(run["out"] / "grid_export.png"), dtype=np.float64)
    assert grid.shape == base.shape == export.shape == (3 * 64, 64, 3)  # a row per prompt
    assert np.array_equal(grid, base)
    assert np.abs(grid - export).max() <= 2  # 8-bit rounding


def test_export_fidelity_is_reported_apart_from_the_gains(run):
    """OpenVINO against the PyTorch fine-tune, same prompts and latents: its own section (PSNR and
    the metric deltas), never in `metrics`, where the gains are exactly 0 whatever the export does."""
    report = run["report"]
    fidelity = report["export_fidelity"]
    assert (fidelity["prompts"], fidelity["images"]) == (3, 3)
    assert 40.0 < fidelity["psnr_min"] <= fidelity["psnr_mean"] <= 100.0
    assert fidelity["max_abs_pixel_diff"] <= 2
    for name in ("clip_t", "clip_i", "dino"):
        assert fidelity[f"pytorch_{name}"] == pytest.approx(report["metrics"][name], abs=1e-6)
        assert fidelity[f"delta_{name}"] == pytest.approx(
            fidelity[name] - fidelity[f"pytorch_{name}"], abs=2e-6)
        assert abs(fidelity[f"delta_{name}"]) < 1e-2
    assert not any("export" in key or "psnr" in key for key in report["metrics"])
    flat = json.loads(run["flat"].read_text())
    assert flat["export_fidelity.psnr_min"] == fidelity["psnr_min"]


def test_per_prompt_table(run):
    with open(run["out"] / "per_prompt.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["prompt"] for r in rows] == run["report"]["prompts"]
    assert rows[0]["clip_t_text"] == "a toy in the jungle"
    metric_columns = ["clip_t", "clip_t_base", "clip_i", "clip_i_base", "dino", "dino_base"]
    assert list(rows[0]) == ["prompt", "clip_t_text", *metric_columns]
    mean = np.mean([float(r["clip_t"]) for r in rows])
    assert mean == pytest.approx(run["report"]["metrics"]["clip_t"], abs=1e-5)


def test_mlflow_run_has_metrics_and_artifacts(run):
    import mlflow

    mlflow.set_tracking_uri(run["mlflow_uri"])
    runs = mlflow.search_runs(
        experiment_names=["finetune"], filter_string="tags.stage = 'evaluate'", output_format="list"
    )
    assert runs, "the evaluate stage logged no MLflow run"
    logged = runs[0]
    clip_i = run["report"]["metrics"]["clip_i"]
    assert logged.data.metrics["clip_i"] == pytest.approx(clip_i, abs=1e-6)
    assert logged.data.tags["gate.passed"] == "false"
    # The protocol the scores were measured under, and that the built-in encoders' are noise.
    assert logged.data.tags["protocol"] == run["report"]["protocol"]["id"]
    assert logged.data.tags["protocol.calibrated"] == "false"
    assert "random (seeded) weights" in logged.data.tags["protocol.note"]
    client = mlflow.MlflowClient(tracking_uri=run["mlflow_uri"])
    names = {a.path for a in client.list_artifacts(logged.info.run_id, "evaluate")}
    assert logged.data.metrics["export_fidelity.psnr_mean"] == pytest.approx(
        run["report"]["export_fidelity"]["psnr_mean"], abs=1e-4)
    for phase, peak in run["report"]["memory"]["peak_rss_mb"].items():
        assert logged.data.metrics[f"memory.peak_rss_mb.{phase}"] == pytest.approx(peak)
    assert logged.data.tags["base_cache"] == "off"
    assert {"evaluate/grid.png", "evaluate/grid_base.png", "evaluate/grid_export.png",
            "evaluate/per_prompt.csv",
            "evaluate/per_prompt_table.json"} <= names


def test_demo_gate_accepts_the_tiny_model_and_rejects_collapsed_images(run):
    """params.yaml's demo thresholds: the tiny model's images pass; all-black images (what a
    diverged fine-tune that outputs NaNs decodes to) fail."""
    from tasks.common.tiny_encoders import load_clip, load_dino
    from tasks.evaluate.core import load_instance_images

    cfg = load_config("evaluate", EvaluateConfig, REPO / "params.yaml")
    thresholds = cfg.gate.model_dump()
    assert any(v is not None for v in thresholds.values()), "the demo gate must check something"
    metrics = run["report"]["metrics"]
    assert M.gate(metrics, thresholds)["passed"]

    clip = load_clip(cfg.clip_model, cfg.encoder_seed)
    dino = load_dino(cfg.dino_model, cfg.encoder_seed)
    real = load_instance_images(run["data"])
    black = [Image.new("RGB", (64, 64))] * 2
    collapsed = dict(metrics)
    collapsed["clip_i"] = M.mean_pairwise_cosine(clip.embed_images(black), clip.embed_images(real))
    collapsed["dino"] = M.mean_pairwise_cosine(dino.embed_images(black), dino.embed_images(real))
    for name in ("clip_i", "dino"):
        collapsed[f"gain_{name}"] = collapsed[name] - metrics[f"base_{name}"]
    verdict = M.gate(collapsed, thresholds)
    assert not verdict["passed"]
    assert not verdict["checks"]["dino"]["passed"] and not verdict["checks"]["gain_dino"]["passed"]


def test_without_base_there_are_no_base_scores(run, tmp_path):
    from tasks.evaluate.core import evaluate

    cfg = EvaluateConfig(prompts=["a {identifier} {class_name}"], images_per_prompt=2,
                         num_inference_steps=1, compare_base=False, gate={"min_clip_i": 0.0}, resolution=32)
    result = evaluate(run["base"], None, run["data"], cfg)
    assert result.base_images is None and len(result.images[0]) == 2
    # no export to fix the size: evaluate.resolution's, in the protocol (the native size would be 64 px)
    assert result.images[0][0].size == (32, 32) and result.report["protocol"]["settings"]["shape"]["height"] == 32
    assert result.report["export_fidelity"] is None  # no --export given
    assert not any(k.startswith(("base_", "gain_")) for k in result.report["metrics"])
    assert list(result.rows[0]) == ["prompt", "clip_t_text", "clip_t", "clip_i", "dino"]
    assert result.report["gate"]["passed"] is True


def test_missing_inputs_are_user_errors(tmp_path):
    from tasks.common.errors import UserError
    from tasks.evaluate.core import evaluate, load_instance_images

    with pytest.raises(UserError, match="ingest"):
        load_instance_images(tmp_path / "none")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no instance images"):
        load_instance_images(tmp_path / "empty")
    data = write_subject_images(tmp_path / "data", n=1)
    with pytest.raises(UserError, match="train stage"):
        evaluate(tmp_path / "no-model", None, data, EvaluateConfig(prompts=["x"]))
    with pytest.raises(UserError, match="export stage"):
        evaluate(tmp_path / "no-model", None, data, EvaluateConfig(prompts=["x"]),
                 export=tmp_path / "no-export")


def test_language_drift_of_the_same_model_is_none(run):
    """The fine-tune is the base here: the class images are the same (one backend, precision)."""
    metrics = run["report"]["metrics"]
    assert metrics["drift_clip_i"] == pytest.approx(1.0, abs=1e-6)
    assert metrics["drift_dino"] == pytest.approx(1.0, abs=1e-6)
    assert run["report"]["generation"]["drift_prompts"] == ["a photo of a toy"]


def test_flat_metrics_file_for_dvc(run):
    flat = json.loads(run["flat"].read_text())
    assert all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in flat.values())
    assert flat["gate.passed"] == 0 and flat["gate.dino.passed"] == 0
    assert flat["gate.clip_i.passed"] == 1
    assert flat["dino"] == run["report"]["metrics"]["dino"]
