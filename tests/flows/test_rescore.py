"""When to re-score the champion, and the evaluate command it is re-scored with (dvc.yaml's own)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from flows.rescore import evaluate_command, needs_rescore
from tasks.register.promotion import Champion
from tests.conftest import REPO

pytestmark = pytest.mark.quick  # make test-fast


def test_a_champion_under_another_protocol_needs_a_rescore() -> None:
    """The champion's protocol as its lineage document records it (tasks/register/registry.py)."""
    report = {"protocol": {"id": "new"}}
    assert needs_rescore(Champion("1", 0.5, "old"), report)
    assert needs_rescore(Champion("1", 0.5, None), report)  # registered before protocols were recorded
    assert needs_rescore(Champion("1", None, None, note="registered without a lineage document"),
                         report)
    assert not needs_rescore(Champion("1", 0.5, "new"), report)
    assert not needs_rescore(None, report)  # no champion
    assert not needs_rescore(Champion("1", 0.5, "old"), {})  # a report without protocol


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
    # registered without an export (export.enabled: false): scored without one, never the workspace's
    assert "--export" not in argv and "models/openvino" not in argv
