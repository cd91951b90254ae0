"""The stage's CLI: SIGTERM to a real `python -m tasks.train` leaves a resumable checkpoint, and the
next run continues from it and writes every output (pipeline, report, loss curve, MLflow)."""
from __future__ import annotations

import csv
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, stage_runs

UNET = "unet/diffusion_pytorch_model.safetensors"
READY = "SIGTERM/SIGINT save a checkpoint"  # logged once the handlers are installed


def wait_for(proc: subprocess.Popen, text: str, timeout: float = 240) -> list[str]:
    """Lines of the process's stderr up to the first containing `text`."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    assert proc.stderr is not None
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        if text in line:
            return lines
    proc.kill()
    raise AssertionError(f"never saw {text!r}; stderr was:\n" + "".join(lines))


def test_sigterm_saves_a_checkpoint_and_the_next_run_resumes(
    tmp_path, tiny_sd, instance_dir, class_dir, isolated_mlflow, monkeypatch
) -> None:
    from mlflow.tracking import MlflowClient

    section = {"max_train_steps": 10_000, "train_batch_size": 1, "resolution": 32, "num_validation_images": 0,
               "checkpointing_steps": 10_000, "checkpoints_dir": str(tmp_path / "ckpt"), "log_every_steps": 2,
               "system_metrics_interval": 0.2}
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"train": section}))
    out = tmp_path / "models" / "finetuned"
    report, plot = tmp_path / "reports" / "train.json", tmp_path / "reports" / "loss.csv"
    argv = ["--base", str(tiny_sd), "--data", str(instance_dir), "--class-data", str(class_dir), "--out", str(out),
            "--report", str(report), "--plot", str(plot), "--params", str(params)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tasks.train", *argv], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}, cwd=tmp_path,
    )
    try:
        wait_for(proc, READY)
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=240)[1]
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, rest
    assert "interrupted by SIGTERM after step" in rest and "checkpoint saved to" in rest, rest
    checkpoints = list((tmp_path / "ckpt").glob("*/checkpoint-*"))
    assert len(checkpoints) == 1 and not out.exists()
    stopped_at = int(checkpoints[0].name.split("-")[1])
    assert stopped_at >= 1
    assert {"optimizer.bin", "scheduler.bin", "random_states_0.pkl", "trainable_unet.safetensors"} <= {
        p.name for p in checkpoints[0].iterdir()}

    # The same run, asked for two more steps (max_train_steps is not part of the run key), in process.
    # select_checkpoint best: checkpoint_scoring follows the register's primary metric (gain_clip_i: ranked as clip_i)
    section.update(max_train_steps=stopped_at + 2, num_validation_images=2, validation_inference_steps=2,
                   select_checkpoint="best")
    params.write_text(yaml.safe_dump({"train": section, "register": {"model_name": "m",
                                                                     "primary_metric": "gain_clip_i"}}))
    monkeypatch.setenv("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "false")  # restored after the test
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "10")
    monkeypatch.setattr(sys, "argv", ["python -m tasks.train", *argv])
    from tasks.train.__main__ import main

    main()
    assert (out / "model_index.json").is_file() and (out / UNET).is_file()
    data = json.loads(report.read_text())
    assert data["steps"] == stopped_at + 2 and data["resumed_from_step"] == stopped_at
    assert math.isfinite(data["final_loss"]) and data["images_per_second"] > 0 and data["peak_memory_mb"] > 0
    with open(plot, newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [int(r["step"]) for r in rows] == list(range(1, stopped_at + 3)), "the whole run's curve"
    assert float(rows[-1]["loss"]) == pytest.approx(data["final_loss"], rel=1e-5)
    assert [r["step"] for r in data["checkpoints"]] == [stopped_at + 2], "the last step is scored with best"
    assert data["selected_checkpoint"]["metric"] == "clip_i" and data["selected_checkpoint"]["step"] == stopped_at + 2

    runs = stage_runs(isolated_mlflow)
    assert [r.info.status for r in runs] == ["FINISHED", "FAILED"]  # newest first
    assert "SIGTERM" in runs[1].data.tags["train.interrupted"]
    # the allocator each run actually ran on: the program re-executed itself under auto's choice,
    # the in-process run is this test's own process
    from tasks.common.allocator import find_allocators, in_use

    assert runs[1].data.tags["train.allocator"] == ("tcmalloc" if "tcmalloc" in find_allocators() else "glibc-tuned")
    assert runs[0].data.tags["train.allocator"] == data["allocator"] == in_use()
    assert data["latent_cache_seconds"] > 0 and {"latent_cache_seconds", "text_cache_seconds"} <= set(
        runs[0].data.metrics)
    assert 0 < data["text_cache_seconds"] < data["total_seconds"]  # its own time, not the clock's origin
    phases = {"text_cache", "load", "steps", "save"}
    assert set(data["peak_rss_mb_by_phase"]) == phases and all(v > 0 for v in data["peak_rss_mb_by_phase"].values())
    assert {f"peak_rss_mb.{p}" for p in phases} <= set(runs[0].data.metrics)
    client = MlflowClient(tracking_uri=isolated_mlflow)
    steps = sorted(m.step for m in client.get_metric_history(runs[0].info.run_id, "loss"))
    assert steps and all(s % 2 == 0 or s == stopped_at + 2 for s in steps), "throttled to log_every_steps"
    assert {"peak_memory_mb", "images_per_second", "grad_norm", "lr", "checkpoint_clip_i"} <= set(runs[0].data.metrics)
    assert any(k.startswith("system/") for k in runs[0].data.metrics), "MLflow system metrics are on"
    artifacts = {a.path for a in client.list_artifacts(runs[0].info.run_id)}
    assert {"train.json", "loss.csv", "validation_grid.png", "weights_sha256.json"} <= artifacts
    assert json.loads(Path(client.download_artifacts(runs[0].info.run_id, "weights_sha256.json",
                                                     str(tmp_path))).read_text()) == data["weights_sha256"]
