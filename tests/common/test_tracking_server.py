"""A stage whose MLflow tracking server is down when it starts: with the real `mlflow server` on a
free loopback port. Chosen behaviour (tasks/common/tracking.py): wait up to FINETUNE_MLFLOW_WAIT_S
for the server, then fail with a clear message before doing any work; never train unrecorded."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.e2e_util import free_port, stop_process_group

STAGE = """\
import pathlib
from tasks.common.errors import main_guard
from tasks.common.tracking import stage_run

@main_guard
def main():
    with stage_run("toy", params={"lr": 0.1}) as run:
        pathlib.Path("trained").write_text("yes")  # the work, only ever inside a recorded run
        run.log_metrics({"loss": 0.5})

main()
"""


def _stage(workdir: Path, uri: str, wait_s: float) -> subprocess.Popen[str]:
    (workdir / "stage.py").write_text(STAGE)
    env = {**os.environ, "PYTHONPATH": str(REPO), "MLFLOW_TRACKING_URI": uri,
           "FINETUNE_MLFLOW_WAIT_S": str(wait_s)}
    return subprocess.Popen([sys.executable, "stage.py"], cwd=workdir, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _server(tmp: Path, port: int) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
           "--workers", "1", "--backend-store-uri", f"sqlite:///{tmp / 'server.db'}",
           "--default-artifact-root", str(tmp / "artifacts")]
    log = open(tmp / "server.log", "wb")  # noqa: SIM115 (the server process holds it)
    return subprocess.Popen(cmd, cwd=tmp, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def test_server_down_fails_fast_with_a_clear_message(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there
    start = time.monotonic()
    proc = _stage(tmp_path, f"http://127.0.0.1:{port}", wait_s=1)
    _, err = proc.communicate(timeout=120)
    print(f"failed after {time.monotonic() - start:.1f} s")
    assert proc.returncode == 2, err[-3000:]
    assert f"the MLflow tracking server http://127.0.0.1:{port} did not answer within 1 s" in err
    assert "nothing ran without a record" in err and "FINETUNE_MLFLOW_WAIT_S" in err
    assert "Traceback" not in err
    assert not (tmp_path / "trained").exists()


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_server_that_comes_up_within_the_bound_is_waited_for(tmp_path: Path) -> None:
    from mlflow import MlflowClient

    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    stage = _stage(tmp_path, uri, wait_s=300)
    time.sleep(3)  # the stage is waiting now
    server = _server(tmp_path, port)
    try:
        _, err = stage.communicate(timeout=400)
        assert stage.returncode == 0, err[-3000:] + (tmp_path / "server.log").read_text()[-2000:]
        assert f"MLflow server {uri} not answering" in err  # it said it was waiting
        (run,) = MlflowClient(tracking_uri=uri).search_runs(
            [MlflowClient(tracking_uri=uri).get_experiment_by_name("finetune").experiment_id])
        assert run.data.tags["stage"] == "toy" and run.data.metrics["loss"] == 0.5
        assert (tmp_path / "trained").read_text() == "yes"
    finally:
        stop_process_group(server)
