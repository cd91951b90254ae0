"""Lineage read from dvc.lock and the evaluation report (no MLflow)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tasks.common.errors import UserError
from tasks.register.lineage import describe, lineage_tags, read_evaluation, read_lock
from tests.register.conftest import DVC_LOCK, EVAL_FAIL, EVAL_PASS


def test_lock_gives_output_hashes_and_the_params_each_stage_ran_with(tmp_path: Path) -> None:
    (tmp_path / "dvc.lock").write_text(DVC_LOCK)
    lock = read_lock(tmp_path / "dvc.lock")
    assert lock.hashes["data/processed"] == "11111111111111111111111111111111.dir"
    assert lock.hashes["models/openvino"] == "33333333333333333333333333333333.dir"
    assert lock.hashes["reports/export.json"] == "44444444444444444444444444444444"
    assert lock.params["train"]["max_train_steps"] == 3
    assert lock.params["ingest"] == {"resolution": 64}


def test_lock_errors_say_to_run_the_pipeline(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="run the pipeline first"):
        read_lock(tmp_path / "dvc.lock")
    (tmp_path / "dvc.lock").write_text(DVC_LOCK.split("  export:")[0])
    with pytest.raises(UserError, match="no hash for models/openvino"):
        read_lock(tmp_path / "dvc.lock")


def test_evaluation_gate(tmp_path: Path) -> None:
    path = tmp_path / "evaluate.json"
    path.write_text(json.dumps(EVAL_PASS))
    ev = read_evaluation(path)
    assert ev.passed is True and ev.metrics == {"clip_t": 0.21, "clip_i": 0.5, "dino": 0.4}
    path.write_text(json.dumps(EVAL_FAIL))
    assert read_evaluation(path).passed is False
    path.write_text(json.dumps({"metrics": {}, "gate": {"passed": "yes"}}))
    with pytest.raises(UserError, match="boolean at 'gate.passed'"):
        read_evaluation(path)
    with pytest.raises(UserError, match="run the evaluate stage first"):
        read_evaluation(tmp_path / "missing.json")


def test_tags_cover_commit_hashes_params_metrics_and_gate(tmp_path: Path) -> None:
    (tmp_path / "dvc.lock").write_text(DVC_LOCK)
    (tmp_path / "e.json").write_text(json.dumps(EVAL_PASS))
    lock, ev = read_lock(tmp_path / "dvc.lock"), read_evaluation(tmp_path / "e.json")
    tags = lineage_tags(lock, ev, {"register": {"model_name": "m"}}, "abc123")
    assert tags["git_commit"] == "abc123"
    assert tags["dvc.md5.models/finetuned"] == "22222222222222222222222222222222.dir"
    assert tags["param.train.max_train_steps"] == "3"
    assert tags["param.train.prompts"] == '["a", "b"]'
    assert tags["param.register.model_name"] == "m"
    assert tags["metric.clip_t"] == "0.21"
    assert tags["gate.passed"] == "true" and tags["gate.checks.clip_t"] == "True"
    assert all(isinstance(v, str) for v in tags.values())
    text = describe(lock, ev, "abc123")
    assert "dreambooth for 3 steps" in text and "the gate passed" in text and "clip_t=0.21" in text
