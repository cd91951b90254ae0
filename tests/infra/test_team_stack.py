"""The team stack's servers started for real, as infra/compose.yaml runs them: PostgreSQL from
Debian's packages on loopback with a temporary data directory (databases from
infra/postgres/init.sql); the Prefect server and the MLflow server (proxied artifacts, here into a
local folder instead of MinIO) on it, with compose's command lines and database URLs. Runs and
registrations land in PostgreSQL, and survive a PostgreSQL restart between runs. A stage whose
MLflow server is killed during its run fails within a bound with a clear message, and its rerun
against the restarted server completes.

The real pipeline run by a worker on this stack, two clones sharing a DVC remote, and a
registration cut off by a dead server: tests/infra/test_team_worker.py. Not tested here
(infra/README.md, "What is validated without Docker"): MinIO and the Docker builds."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.e2e_util import e2e_env, free_port, stop_process_group
from tests.infra.stack import (
    COMPOSE,
    NO_POSTGRES,
    Postgres,
    debian_postgres_bin,
    needs_psycopg2,
    pipeline_credentials,
    start_mlflow,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


REGISTER = """
import sys, mlflow

class Double(mlflow.pyfunc.PythonModel):
    def predict(self, context, model_input, params=None):
        return [2 * x for x in model_input]

mlflow.set_experiment("stack")
with mlflow.start_run() as run:
    mlflow.log_metric("loss", 0.5)
    info = mlflow.pyfunc.log_model(name="model", python_model=Double(), pip_requirements=[],
                                   registered_model_name="stack-model")
client = mlflow.MlflowClient()
client.set_registered_model_alias("stack-model", "champion", info.registered_model_version)
print(info.registered_model_version)
"""

LOAD = """
import mlflow
model = mlflow.pyfunc.load_model("models:/stack-model@champion")
print(model.predict([1, 2]))
"""


def mlflow_client(uri: str, tmp: Path, code: str) -> str:
    script = tmp / "client.py"
    script.write_text(code)
    env = e2e_env(REPO, MLFLOW_TRACKING_URI=uri, **pipeline_credentials())
    done = subprocess.run([sys.executable, str(script)], cwd=tmp, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


FLOW = """
import sys
from prefect import flow

@flow(name="stack-probe")
def probe(n: int) -> int:
    return n + 1

assert probe(int(sys.argv[1])) == int(sys.argv[1]) + 1
"""


def run_flow(api: str, tmp: Path, n: int) -> None:
    script = tmp / "probe.py"
    script.write_text(FLOW)
    env = e2e_env(REPO, PREFECT_API_URL=api, **pipeline_credentials())
    env["PREFECT_HOME"] = str(tmp / "client")
    done = subprocess.run([sys.executable, str(script), str(n)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_compose_runs_the_postgresql_major_the_tests_start() -> None:
    bindir = debian_postgres_bin()
    if bindir is None:
        pytest.skip(NO_POSTGRES)
    image = COMPOSE["services"]["postgres"]["image"]
    assert image == f"postgres:{bindir.parent.name}", "compose's postgres and Debian's differ"


def test_prefect_records_runs_in_postgresql_across_a_database_restart(
    postgres: Postgres, prefect_on_postgres: str, tmp_path: Path
) -> None:
    completed = "select count(*) from flow_run r join flow f on f.id = r.flow_id " \
                "where f.name = 'stack-probe' and r.state_type = 'COMPLETED'"
    run_flow(prefect_on_postgres, tmp_path, 1)
    assert postgres.query("prefect", completed) == [(1,)]

    postgres.ctl("restart")  # the server's pooled connections die with it
    run_flow(prefect_on_postgres, tmp_path, 2)
    assert postgres.query("prefect", completed) == [(2,)]


def test_mlflow_registers_in_postgresql_with_proxied_artifacts_across_a_database_restart(
    postgres: Postgres, mlflow_on_postgres: tuple[str, Path], tmp_path: Path
) -> None:
    uri, artifacts = mlflow_on_postgres
    champion = "select a.version from registered_model_aliases a where a.name = 'stack-model' " \
               "and a.alias = 'champion'"
    assert mlflow_client(uri, tmp_path, REGISTER) == "1"
    assert postgres.query("mlflow", champion) == [(1,)]
    assert mlflow_client(uri, tmp_path, LOAD) == "[2, 4]"  # a second process, through the server
    # Proxied: the client sent the files to the server, which wrote them to its destination.
    assert list(artifacts.rglob("MLmodel")), "no model files under the server's artifact folder"
    assert not list(tmp_path.rglob("MLmodel")), "the client wrote artifacts itself"

    postgres.ctl("restart")
    assert mlflow_client(uri, tmp_path, REGISTER) == "2"
    assert postgres.query("mlflow", champion) == [(2,)]
    assert postgres.query("mlflow", "select count(*) from runs where status = 'FINISHED'") == [(2,)]


STAGE = """
import pathlib, time
from tasks.common.errors import main_guard
from tasks.common.tracking import stage_run

@main_guard
def main():
    with stage_run("toy", params={"lr": 0.1}) as run:
        pathlib.Path("started").touch()
        while not pathlib.Path("go").exists():  # the test kills the server meanwhile
            time.sleep(0.2)
        run.log_metrics({"loss": 0.5})
        pathlib.Path("trained").write_text("yes")

main()
"""


def test_a_stage_whose_mlflow_server_dies_fails_within_the_bound_and_the_rerun_completes(
    postgres: Postgres, tmp_path: Path
) -> None:
    needs_psycopg2()
    home, work = tmp_path / "server", tmp_path / "work"
    home.mkdir(), work.mkdir()
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    # A short retry budget, so the bound is seconds here (MLflow's defaults allow minutes).
    env = e2e_env(REPO, MLFLOW_TRACKING_URI=uri, MLFLOW_EXPERIMENT_NAME="fault",
                  **pipeline_credentials(),
                  MLFLOW_HTTP_REQUEST_MAX_RETRIES="2", MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR="1",
                  MLFLOW_HTTP_REQUEST_TIMEOUT="10", FINETUNE_MLFLOW_WAIT_S="5")
    (work / "stage.py").write_text(STAGE)

    def stage() -> subprocess.Popen:
        for name in ("started", "go"):
            (work / name).unlink(missing_ok=True)
        return subprocess.Popen([sys.executable, "stage.py"], cwd=work, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    server = start_mlflow(postgres, home, port)
    first = stage()
    try:
        deadline = time.monotonic() + 120
        while not (work / "started").exists():
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.2)
    finally:
        stop_process_group(server)  # the server dies with the stage's run open
    (work / "go").touch()
    start = time.monotonic()
    _, err = first.communicate(timeout=300)
    failed_after = time.monotonic() - start
    print(f"the stage failed {failed_after:.1f} s after the server died")
    assert first.returncode == 2, err[-3000:]
    assert f"error: the MLflow tracking server {uri} stopped answering during the run of stage " \
           "'toy'" in err, err[-3000:]
    assert "Restart the server" in err and "Traceback" not in err
    assert failed_after < 120
    assert not (work / "trained").exists(), "no work is reported done without its record"

    server = start_mlflow(postgres, home, port)  # restarted on the same database
    try:
        second = stage()
        (work / "go").touch()
        _, err = second.communicate(timeout=300)
        assert second.returncode == 0, err[-3000:]
    finally:
        stop_process_group(server)
    statuses = postgres.query("mlflow", "select r.status from runs r join experiments e on "
                              "e.experiment_id = r.experiment_id where e.name = 'fault' "
                              "order by r.start_time")
    # The first run stays open in the database (nobody could close it); the rerun is recorded.
    assert [s for (s,) in statuses] == ["RUNNING", "FINISHED"]
