"""One temporary Prefect server (prefect_test_harness) for the flow tests that need one, and the
toy DVC project they run the flow on."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import flows.finetune as finetune_module
from tests.conftest import REPO


@pytest.fixture(scope="session")
def prefect_server():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


STAGE_CODE = """\
import os, signal, sys, yaml, pathlib
from tasks.common.tracking import stage_run
name = sys.argv[1]
params = yaml.safe_load(open("params.yaml"))[name]
with open(f"{name}.attempts", "a") as f:
    f.write("x")
if params.get("kill_once") and not pathlib.Path(f"{name}.killed").exists():
    pathlib.Path(f"{name}.killed").touch()
    os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer would
if params.get("fail"):
    sys.exit(f"error: params.yaml: {name}.fail is set")
with stage_run(name, params=params) as run:
    run.log_metrics({"value": params["value"]})
pathlib.Path(f"{name}.out").write_text(str(params["value"]))
"""


@pytest.fixture
def toy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "toy"
    root.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=root, check=True)
    (root / "stage.py").write_text(STAGE_CODE)
    stages = {
        name: {"cmd": f"python stage.py {name}", "deps": ["stage.py"], "params": [name],
               "outs": [f"{name}.out"]}
        for name in ("second", "first")  # dvc.yaml order, not alphabetical, is the run order
    }
    stages["first"]["deps"].append("second.out")
    (root / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}, sort_keys=False))
    (root / "params.yaml").write_text("second:\n  value: 1  # kept\n  fail: false\n  kill_once: false\n"
                                      "first:\n  value: 2\nregister:\n  model_name: toy\n")
    (root / ".gitignore").write_text("*.attempts\n*.killed\n")
    git(root, "add", "-A")
    git(root, "-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-q", "-m", "toy")
    monkeypatch.setattr(finetune_module, "REPO", root)  # the flow runs in this repo instead
    monkeypatch.setenv("PYTHONPATH", str(REPO))  # the toy stages import tasks.common
    return root


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True,
                          text=True).stdout
