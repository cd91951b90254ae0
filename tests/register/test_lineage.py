"""Lineage read from dvc.lock and the evaluation report (no MLflow)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tasks.common.errors import UserError
from tasks.register.lineage import (
    describe,
    fingerprint,
    inputs,
    lineage_record,
    read_evaluation,
    read_lock,
    summary_tags,
)
from tests.register.conftest import DVC_LOCK, EVAL_FAIL, EVAL_PASS

pytestmark = pytest.mark.quick  # make test-fast


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


def test_a_few_tags_and_the_full_lineage_in_one_document(tmp_path: Path) -> None:
    (tmp_path / "dvc.lock").write_text(DVC_LOCK)
    (tmp_path / "e.json").write_text(json.dumps(EVAL_PASS))
    lock, ev = read_lock(tmp_path / "dvc.lock"), read_evaluation(tmp_path / "e.json")
    tags = summary_tags(lock, ev, "abc123", "dino", {"dvc.experiment": "flow-x"})
    assert tags == {"base": "?", "method": "dreambooth",
                    "data": "11111111111111111111111111111111.dir", "git_commit": "abc123",
                    "metric.dino": "0.4", "gate": "passed",
                    "protocol": "unknown (the report has no protocol section)",
                    "lineage.fingerprint": fingerprint(inputs(lock)), "dvc.experiment": "flow-x"}
    record = lineage_record(lock, ev, {"register": {"model_name": "m"}}, "abc123")
    json.dumps(record)  # one JSON document
    assert record["git_commit"] == "abc123"
    assert record["outputs"]["models/finetuned"] == "22222222222222222222222222222222.dir"
    assert record["params"]["train"]["prompts"] == ["a", "b"]
    assert record["params"]["register"] == {"model_name": "m"}
    assert record["metrics"] == EVAL_PASS["metrics"] and record["gate"]["passed"] is True
    assert record["inputs"]["param.train.max_train_steps"] == "3"
    assert record["inputs"]["dvc.md5.data/processed"] == "11111111111111111111111111111111.dir"
    assert not any(k.startswith("param.register.") for k in record["inputs"])
    assert record["fingerprint"] == tags["lineage.fingerprint"]
    text = describe(lock, ev, "abc123", "dino")
    assert "dreambooth for 3 steps" in text and "the gate passed" in text and "dino=0.4" in text


def test_the_fingerprint_follows_data_and_params_only(tmp_path: Path) -> None:
    (tmp_path / "dvc.lock").write_text(DVC_LOCK)
    lock = read_lock(tmp_path / "dvc.lock")
    (tmp_path / "dvc.lock").write_text(DVC_LOCK.replace("max_train_steps: 3", "max_train_steps: 4"))
    changed = read_lock(tmp_path / "dvc.lock")
    assert fingerprint(inputs(lock)) == fingerprint(inputs(read_lock(tmp_path / "dvc.lock").__class__(
        lock.hashes, {**lock.params, "register": {"model_name": "other"}})))
    assert fingerprint(inputs(lock)) != fingerprint(inputs(changed))


def test_an_uncalibrated_evaluation_says_so_in_tag_and_description(tmp_path: Path) -> None:
    (tmp_path / "dvc.lock").write_text(DVC_LOCK)
    report = {**EVAL_PASS, "protocol": {
        "id": "0123abcd4567", "calibrated": False, "settings": {},
        "uncalibrated_reason": "uncalibrated scores: builtin:tiny-clip have random weights"}}
    (tmp_path / "e.json").write_text(json.dumps(report))
    lock, ev = read_lock(tmp_path / "dvc.lock"), read_evaluation(tmp_path / "e.json")
    assert summary_tags(lock, ev, "abc", "dino")["protocol"] == "0123abcd4567 (uncalibrated)"
    text = describe(lock, ev, "abc", "dino")
    assert text.startswith("Uncalibrated scores: builtin:tiny-clip have random weights. ")
    assert lineage_record(lock, ev, {}, "abc")["protocol"]["id"] == "0123abcd4567"


def test_single_keys_a_stage_tracks_from_another_section_nest(tmp_path: Path) -> None:
    """train tracks register.primary_metric and evaluate's encoders (its checkpoint scoring follows them)."""
    (tmp_path / "dvc.lock").write_text(
        "schema: '2.0'\nstages:\n  train:\n    cmd: x\n    params:\n      params.yaml:\n"
        "        register.primary_metric: dino\n        evaluate.clip_model: builtin:tiny-clip\n"
        "        train:\n          max_train_steps: 3\n"
        "  evaluate:\n    cmd: y\n    params:\n      params.yaml:\n        evaluate:\n"
        "          clip_model: builtin:tiny-clip\n          seed: 0\n")
    lock = read_lock(tmp_path / "dvc.lock", required=())
    assert lock.params == {"register": {"primary_metric": "dino"}, "train": {"max_train_steps": 3},
                           "evaluate": {"clip_model": "builtin:tiny-clip", "seed": 0}}
    assert set(inputs(lock)) == {"param.train.max_train_steps", "param.evaluate.clip_model", "param.evaluate.seed"}


def test_launch_env_secrets_from_dvc_lock_never_reach_the_lineage_or_tags(tmp_path: Path) -> None:
    """A token put in params.yaml's train.launch.env is in dvc.lock; the lineage document, its
    inputs (version tags) and fingerprint show *** in its place, other variables as they are."""
    (tmp_path / "dvc.lock").write_text(
        "schema: '2.0'\nstages:\n  train:\n    cmd: x\n    params:\n      params.yaml:\n        train:\n"
        "          launch:\n            env:\n              HF_TOKEN: hf_planted_secret\n"
        "              OMP_PROC_BIND: close\n")
    lock = read_lock(tmp_path / "dvc.lock", required=())
    assert lock.params["train"]["launch"]["env"] == {"HF_TOKEN": "***", "OMP_PROC_BIND": "close"}
    record = lineage_record(lock, read_evaluation_pass(tmp_path), {}, None)
    assert "hf_planted_secret" not in json.dumps(record)
    assert record["inputs"]["param.train.launch.env.HF_TOKEN"] == "***"


def read_evaluation_pass(tmp_path: Path):
    (tmp_path / "evaluate.json").write_text(json.dumps(EVAL_PASS))
    return read_evaluation(tmp_path / "evaluate.json")
