"""When to re-score the champion, and the evaluate command it is re-scored with (dvc.yaml's own)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from flows.rescore import evaluate_command, needs_rescore
from tests.conftest import REPO

pytestmark = pytest.mark.quick  # make test-fast


def test_a_champion_under_another_protocol_needs_a_rescore() -> None:
    report = {"protocol": {"id": "new"}}
    assert needs_rescore({"protocol": "old (calibrated)"}, report)
    assert needs_rescore({}, report)  # registered before protocols were recorded
    assert not needs_rescore({"protocol": "new (uncalibrated)"}, report)
    assert not needs_rescore(None, report)  # no champion
    assert not needs_rescore({"protocol": "old (calibrated)"}, {})  # a report without protocol


def test_the_rescore_runs_dvc_yamls_evaluate_command_on_the_champion(tmp_path: Path) -> None:
    argv = evaluate_command(REPO, {"finetuned": Path("/m/finetuned"),
                                   "openvino": Path("/m/openvino")}, tmp_path)
    assert argv[:3] == [sys.executable, "-m", "tasks.evaluate"]
    args = dict(zip(argv[3::2], argv[4::2]))
    # the champion's PyTorch fine-tune for the gains, its OpenVINO export for the fidelity
    assert args["--model"] == "/m/finetuned" and args["--export"] == "/m/openvino"
    assert args["--base"] == "models/base" and args["--instance-data"] == "data/processed"
    assert args["--report"] == str(tmp_path / "evaluate.json")
    assert args["--out"] == str(tmp_path / "evaluate")
    assert args["--metrics"] == str(tmp_path / "evaluate_metrics.json")
    # LoRA registered unfused: its adapters are applied to the base it was registered with
    argv = evaluate_command(REPO, {"finetuned": Path("/m/finetuned"), "base": Path("/m/base")},
                            tmp_path)
    assert dict(zip(argv[3::2], argv[4::2]))["--base"] == "/m/base"
