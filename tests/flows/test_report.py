"""The flow run's markdown summary (pure): metrics, gate, model version, links to MLflow."""
from __future__ import annotations

import pytest

from flows.report import markdown

pytestmark = pytest.mark.quick  # make test-fast

SUMMARY = {
    "mlflow_run_id": "abc", "mlflow_experiment_id": "7",
    "stages": [{"stage": "train", "status": "ran", "seconds": 12.5}],
    "registered": {"name": "sd", "version": "3", "aliases": ["candidate", "champion"],
                   "decision": "promoted: the gate passed and it beats the champion (...)"},
    "evaluation": {"metrics": {"dino": 0.91234, "clip_i": 0.93},
                   "gate": {"passed": True, "checks": {"min_dino": True}}},
}


def test_summary_links_the_run_and_the_version_on_a_tracking_server(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_UI_URL", raising=False)
    page = markdown(SUMMARY, "http://mlflow.team:5000/")
    assert "MLflow run: [abc](http://mlflow.team:5000/#/experiments/7/runs/abc)" in page
    assert "[sd version 3](http://mlflow.team:5000/#/models/sd/versions/3), aliases: `candidate`, `champion`" in page
    assert "| dino | 0.9123 |" in page and "| train | ran | 12.5 |" in page
    assert "## Gate: passed (min_dino: ok)" in page
    assert "Champion: promoted: the gate passed and it beats the champion" in page
    assert "Export fidelity" not in page  # not measured: no section


def test_export_fidelity_has_its_own_section_apart_from_the_metrics() -> None:
    evaluation = {**SUMMARY["evaluation"], "export_fidelity": {
        "backend": "openvino-static", "psnr_mean": 41.5, "psnr_min": 38.25, "delta_dino": -0.0021}}
    page = markdown({**SUMMARY, "evaluation": evaluation}, "sqlite:///x")
    metrics, fidelity = page.split("## Export fidelity (openvino-static vs the PyTorch fine-tune)")
    assert "| dino | 0.9123 |" in metrics and "psnr" not in metrics
    assert "| psnr_min | 38.2500 |" in fidelity and "| delta_dino | -0.0021 |" in fidelity


def test_local_store_points_at_make_mlflow_ui_and_failed_gate_stands_out(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_UI_URL", raising=False)
    failed = {**SUMMARY, "evaluation": {"metrics": {}, "gate": {"passed": False,
                                                                "checks": {"min_dino": False}}}}
    page = markdown(failed, "sqlite:////tmp/mlflow.db")
    assert "(http://127.0.0.1:5000/#/experiments/7/runs/abc)" in page
    assert "## Gate: **did not pass** (min_dino: FAILED)" in page
    monkeypatch.setenv("MLFLOW_UI_URL", "https://ml.example.org/")
    assert "(https://ml.example.org/#/models/sd/versions/3)" in markdown(SUMMARY, "sqlite:///x")
