"""A stage's process holds only the credentials of its row in tasks/common/credentials.py: ingest,
run by the flow's stage runner (the real `dvc repro`) or relayed to a real MLflow server, never
sees the MLflow password, the S3 secret or Prefect's auth string planted in the caller's
environment. What the stage saw is read from its own /proc/self/environ, written at interpreter
start by a sitecustomize module the test puts first on PYTHONPATH."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from flows import dvc_stage
from tasks.common.tracking import server_answers
from tests.conftest import REPO
from tests.e2e_util import free_port, stop_process_group

PLANTED = {"MLFLOW_TRACKING_USERNAME": "planted-user", "MLFLOW_TRACKING_PASSWORD": "planted-secret-123",
           "AWS_ACCESS_KEY_ID": "planted-key-id", "AWS_SECRET_ACCESS_KEY": "planted-aws-456",
           "PREFECT_API_AUTH_STRING": "finetune:planted-prefect-789", "HF_TOKEN": "planted-hf-000"}

SITECUSTOMIZE = """\
import json, os, sys
if "tasks.ingest" in sys.orig_argv and os.environ.get("ENVIRON_LOG"):
    with open("/proc/self/environ", "rb") as f:
        seen = [e.decode(errors="replace") for e in f.read().split(b"\\0") if e]
    with open(os.environ["ENVIRON_LOG"], "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "environ": seen}) + "\\n")
"""


def _hook(tmp: Path) -> dict[str, str]:
    """PYTHONPATH and ENVIRON_LOG that make every ingest interpreter record its environment."""
    hook = tmp / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return {"PYTHONPATH": f"{hook}{os.pathsep}{REPO}", "ENVIRON_LOG": str(tmp / "environ.jsonl")}


def _seen(tmp: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp / "environ.jsonl").read_text().splitlines()]


def _leaks(environ: list[str], names: tuple[str, ...] = tuple(PLANTED)) -> list[str]:
    return [name for name in names if any(PLANTED[name] in entry for entry in environ)]


def _project(tmp: Path) -> Path:
    """A DVC project holding the ingest stage of dvc.yaml and the demo images."""
    root = tmp / "project"
    subprocess.run([sys.executable, str(REPO / "data/demo/generate.py"), "--out", str(root / "data/subject")],
                   check=True, capture_output=True)
    subprocess.run([sys.executable, "-m", "dvc", "init", "--no-scm", "-q"], cwd=root, check=True)
    stage = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]["ingest"]
    stage["deps"] = ["${ingest.data_dir}"]  # its code is in REPO, on PYTHONPATH
    (root / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"ingest": stage}}))
    params = yaml.safe_load((REPO / "params.yaml").read_text())["ingest"]
    params.update(data_dir="data/subject", sources=[{"type": "folder", "path": "data/subject"}], cache_dir=None)
    (root / "params.yaml").write_text(yaml.safe_dump({"ingest": params}))
    return root


def test_ingest_run_by_the_flows_stage_runner_holds_no_credential(tmp_path, isolated_mlflow, monkeypatch) -> None:
    for name, value in PLANTED.items():
        monkeypatch.setenv(name, value)
    root = _project(tmp_path)
    lines: list[str] = []
    result = dvc_stage.repro("ingest", root, _hook(tmp_path), log=lines.append)
    assert result.status == "ran", "\n".join(lines[-30:])
    (pid,) = {r["pid"] for r in _seen(tmp_path)}
    first, last = _seen(tmp_path)
    # DVC started the stage with the flow's "dvc" row: its remote's keys, never Prefect's auth string
    assert _leaks(first["environ"]) == ["MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD",
                                        "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "HF_TOKEN"]
    assert _leaks(last["environ"]) == [], "the stage re-executed itself (same pid) without any credential"
    assert f"ENVIRON_LOG={tmp_path / 'environ.jsonl'}" in last["environ"]  # the rest of the environment stays
    assert (root / "data/processed/metadata.jsonl").is_file() and pid > 0


@pytest.mark.e2e  # a real `mlflow server`: 40 s here
def test_ingest_on_a_tracking_server_is_relayed_without_its_credentials(tmp_path, migrated_mlflow_db) -> None:
    from mlflow import MlflowClient

    shutil.copy(migrated_mlflow_db, tmp_path / "server.db")  # no migrations at the server's start
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}", "--default-artifact-root",
         str(tmp_path / "artifacts")], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True)
    try:
        root = _project(tmp_path)
        env = {**os.environ, **PLANTED, **_hook(tmp_path), "MLFLOW_TRACKING_URI": uri, "FINETUNE_MLFLOW_WAIT_S": "60"}
        _wait(uri)
        client = MlflowClient(uri)
        parent = client.create_run(client.create_experiment("finetune"), run_name="pipeline").info.run_id
        env["FINETUNE_PARENT_RUN_ID"] = parent
        cmd = yaml.safe_load((root / "dvc.yaml").read_text())["stages"]["ingest"]["cmd"].split()
        proc = subprocess.run([sys.executable, *cmd[1:]], cwd=root, env=env, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "relayed: the stage held no MLflow credentials" in proc.stderr
        holder, stage = _seen(tmp_path)[-2:]  # the relaying process, then the stage it started
        assert _leaks(holder["environ"], ("MLFLOW_TRACKING_PASSWORD",)) == ["MLFLOW_TRACKING_PASSWORD"]
        assert _leaks(stage["environ"]) == [] and stage["pid"] != holder["pid"]
        (run,) = client.search_runs([client.get_experiment_by_name("finetune").experiment_id], "tags.stage = 'ingest'")
        assert run.info.status == "FINISHED" and run.data.tags["mlflow.parentRunId"] == parent
        assert run.data.metrics["kept"] == 6 and run.data.params["resolution"] == str(
            yaml.safe_load((root / "params.yaml").read_text())["ingest"]["resolution"])
        assert {"ingest_samples.png", "ingest.json", "metadata.jsonl"} <= {
            a.path for a in client.list_artifacts(run.info.run_id)}
        assert not (root / "mlruns").exists()
    finally:
        stop_process_group(server)


def _wait(uri: str, timeout: float = 60) -> None:
    start = time.monotonic()
    while not server_answers(uri):
        assert time.monotonic() - start < timeout, f"the MLflow server at {uri} did not start"
        time.sleep(0.5)


@pytest.fixture(autouse=True)
def _no_parent(monkeypatch) -> None:
    monkeypatch.delenv("FINETUNE_PARENT_RUN_ID", raising=False)
