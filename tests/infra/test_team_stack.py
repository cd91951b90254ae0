"""The team stack's servers started for real, as infra/compose.yaml runs them: PostgreSQL from
Debian's packages on loopback with a temporary data directory, password authentication and the
roles and databases of infra/postgres/init.sh; the Prefect server and the MLflow server (basic-auth
app; proxied artifacts, here into a local folder instead of MinIO) on it, with compose's command
lines and environments. Runs and registrations land in PostgreSQL, and survive a PostgreSQL
restart between runs. A stage whose MLflow server is killed during its run fails within a bound
with a clear message, and its rerun against the restarted server completes. The doors are locked:
anonymous, reader and wrong-password writes refused on MLflow, deployments refused on Prefect
without the auth string or a CSRF token, a stage run as the wrong user stopped before any work,
each PostgreSQL role kept to its own databases; a version registered without a manifest is refused
by `make serve-model`'s entry and by the re-score unless FINETUNE_ALLOW_UNVERIFIED=1 (infra/README.md,
"Users and permissions", names the test of each role).

The real pipeline run by a worker on this stack, two clones sharing a DVC remote, and a
registration cut off by a dead server: tests/infra/test_team_worker.py. Not tested here
(infra/README.md, "What is validated without Docker"): MinIO and the Docker builds."""
from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO
from tests.e2e_util import e2e_env, free_port, stop_process_group
from tests.infra.stack import (
    COMPOSE,
    NO_POSTGRES,
    Postgres,
    access_tool,
    add_user,
    compose_env,
    debian_postgres_bin,
    login,
    needs_psycopg2,
    pipeline_client,
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
import os, mlflow
# a plain MLflow model, registered without the pipeline's manifest: loading one is refused unless
# allowed (tasks/register/manifest.py; tests/register/test_manifest.py)
os.environ["FINETUNE_ALLOW_UNVERIFIED"] = "1"
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

    server = start_mlflow(postgres, home, port, bootstrap=False)  # restarted, same database
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


def _status(method: str, url: str, auth: tuple[str, str] | None = None, **kwargs: Any) -> int:
    import requests

    return requests.request(method, url, auth=auth, timeout=30, **kwargs).status_code


def test_mlflow_lets_in_only_the_pipeline_to_write_its_model(
    mlflow_on_postgres: tuple[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:

    uri, _ = mlflow_on_postgres
    model = compose_env("mlflow-init")["REGISTERED_MODEL"]
    reader = ("alice", f"reader/{uuid.uuid4().hex}")
    add_user(uri, *reader)
    pipeline = pipeline_client(uri, monkeypatch)
    run = pipeline.create_run(pipeline.create_experiment(f"doors-{uuid.uuid4().hex[:8]}"))
    source = f"{run.info.artifact_uri}/model"
    v1 = pipeline.create_model_version(model, source=source, run_id=run.info.run_id)
    pipeline.set_registered_model_alias(model, "champion", v1.version)

    api = f"{uri}/api/2.0/mlflow"
    writes = {
        "register a version": ("POST", "/model-versions/create",
                               {"json": {"name": model, "source": source,
                                         "run_id": run.info.run_id}}),
        "move an alias": ("POST", "/registered-models/alias",
                          {"json": {"name": model, "alias": "champion", "version": v1.version}}),
        "forge a tag": ("POST", "/model-versions/set-tag",
                        {"json": {"name": model, "version": v1.version, "key": "metric.dino",
                                  "value": "1.0"}}),
        "delete a version": ("DELETE", "/model-versions/delete",
                             {"json": {"name": model, "version": v1.version}}),
        "write the run's lineage.json": (
            "PUT", f"-artifacts/artifacts/{run.info.experiment_id}/{run.info.run_id}/artifacts/"
                   "lineage.json", {"data": b"{}"}),
    }
    refused = {}
    for what, (method, path, kwargs) in writes.items():
        url = api + path  # `-artifacts/...`: the artifact proxy, /api/2.0/mlflow-artifacts/...
        refused[what] = (_status(method, url, **kwargs), _status(method, url, reader, **kwargs),
                         _status(method, url, ("pipeline", "not-its-password"), **kwargs))
    print(f"(anonymous, reader, wrong password) per write: {refused}")
    assert all(codes == (401, 403, 401) for codes in refused.values()), refused
    get = f"{api}/registered-models/get"
    assert _status("GET", get, params={"name": model}) == 401
    assert _status("GET", get, reader, params={"name": model}) == 200  # readers read
    # The pipeline holds EDIT, not MANAGE: it cannot delete what it registered.
    pipeline_auth = ("pipeline", pipeline_credentials()["MLFLOW_TRACKING_PASSWORD"])
    method, path, kwargs = writes["delete a version"]
    assert _status(method, api + path, pipeline_auth, **kwargs) == 403
    assert pipeline.get_model_version_by_alias(model, "champion").version == v1.version


def test_bootstrap_owns_what_the_pipeline_writes_to_and_the_pipeline_deletes_nothing(
    mlflow_on_postgres: tuple[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fixture ran compose's mlflow-init (bootstrap): the admin made the `finetune` experiment,
    `<model>` and `<model>-base`, so a reader cannot create them first (and own them); the
    pipeline, EDIT on each, creates runs and registers versions there but deletes nothing."""
    import mlflow
    from mlflow.exceptions import MlflowException
    from mlflow.server import get_app_client

    from tasks.common.errors import UserError
    from tasks.register.core import create_version
    from tasks.register.registry import ensure_registered_model

    uri, _ = mlflow_on_postgres
    model = compose_env("mlflow-init")["REGISTERED_MODEL"]
    names, client = [model, f"{model}-base"], mlflow.MlflowClient(uri)
    reader = ("carol", f"reader/{uuid.uuid4().hex}")
    access_tool(monkeypatch, uri, "add-user", reader[0], stdin=reader[1])
    assert "EDIT on experiment 'finetune'" in access_tool(
        monkeypatch, uri, "add-user", "ci", "--role", "pipeline", stdin=uuid.uuid4().hex)
    login(monkeypatch, *reader)
    for create, name in [(client.create_experiment, "finetune"),
                         *((client.create_registered_model, n) for n in names)]:
        with pytest.raises(MlflowException) as taken:
            create(name)
        assert taken.value.error_code == "RESOURCE_ALREADY_EXISTS", name
    experiment = client.get_experiment_by_name("finetune").experiment_id
    with pytest.raises(MlflowException, match="403"):
        client.create_run(experiment)

    login(monkeypatch, "pipeline", pipeline_credentials()["MLFLOW_TRACKING_PASSWORD"])
    run = client.create_run(experiment)  # EDIT on the experiment creates runs in it
    source = f"{run.info.artifact_uri}/model"
    versions = [create_version(client, n, source, None, run.info.run_id, {"gate": "passed"}, "test")
                for n in names if ensure_registered_model(client, n) is None]
    client.set_registered_model_alias(model, "champion", versions[0])
    for delete, args in [(client.delete_model_version, (names[1], versions[1])),
                         (client.delete_registered_model, (names[1],)),
                         (client.delete_run, (run.info.run_id,)),
                         (client.delete_experiment, (experiment,))]:
        with pytest.raises(MlflowException, match="403"):
            delete(*args)
    with pytest.raises(UserError, match="'elsewhere' does not exist on the tracking server"):
        ensure_registered_model(client, "elsewhere")  # it would be the pipeline's to delete

    access = get_app_client("basic-auth", tracking_uri=uri)
    login(monkeypatch, "admin", compose_env("mlflow-init")["MLFLOW_TRACKING_PASSWORD"])
    access.revoke_user_permission("pipeline", "registered_model", names[1])
    access.grant_user_permission("pipeline", "registered_model", names[1], "MANAGE")
    assert f"EDIT (lowered from MANAGE) on registered model '{names[1]}'" in access_tool(
        monkeypatch, uri, "bootstrap")
    resources = [("experiment", experiment), *(("registered_model", n) for n in names)]
    held = {user: {access.get_user_permission(user, *r).permission for r in resources}
            for user in ("pipeline", "ci", "carol")}
    assert held == {"pipeline": {"EDIT"}, "ci": {"EDIT"}, "carol": {"READ"}}


def test_prefect_refuses_requests_without_the_auth_string_or_a_csrf_token(
    prefect_on_postgres: str
) -> None:
    import requests

    api = prefect_on_postgres
    auth = tuple(pipeline_credentials()["PREFECT_API_AUTH_STRING"].split(":", 1))
    deployment = {"name": "intruder", "flow_id": str(uuid.uuid4()), "work_pool_name": "finetune",
                  "pull_steps": [{"prefect.deployments.steps.run_shell_script":
                                  {"script": "echo owned"}}]}
    assert _status("POST", f"{api}/deployments/", json=deployment) in (401, 403)
    assert _status("GET", f"{api}/csrf-token", params={"client": "x"}) == 401
    # Prefect's own client fetches a CSRF token first, as the worker and `prefect deploy` do.
    session = requests.Session()
    session.auth = auth
    token = session.get(f"{api}/csrf-token", params={"client": "doors"}, timeout=30).json()["token"]
    csrf = {"Prefect-Csrf-Token": token, "Prefect-Csrf-Client": "doors"}
    # A valid token without the auth string, or with a wrong one: refused by the auth check.
    assert _status("POST", f"{api}/deployments/", headers=csrf, json=deployment) == 401
    assert _status("POST", f"{api}/deployments/", ("finetune", "guess"), headers=csrf,
                   json=deployment) == 401
    # The right auth string but no CSRF token (a browser page replaying it): refused.
    assert _status("POST", f"{api}/deployments/", auth, json=deployment) == 403
    assert _status("POST", f"{api}/flows/filter", auth, json={}) == 403
    flows = session.post(f"{api}/flows/filter", json={}, timeout=30, headers=csrf)
    assert flows.status_code == 200, flows.text
    # A web page elsewhere may not call the API from a browser: no CORS grant for its origin.
    preflight = requests.options(f"{api}/deployments/", timeout=30, headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    assert preflight.headers.get("access-control-allow-origin") != "http://evil.example"
    ui = compose_env("prefect-server")["PREFECT_SERVER_API_CORS_ALLOWED_ORIGINS"]
    allowed = requests.options(f"{api}/deployments/", timeout=30, headers={
        "Origin": ui, "Access-Control-Request-Method": "POST"})
    assert allowed.headers.get("access-control-allow-origin") == ui


OWN_STAGE = """
import pathlib
from tasks.common.errors import main_guard
from tasks.common.tracking import stage_run

@main_guard
def main():
    with stage_run("toy", params={"lr": 0.1}):
        pathlib.Path("trained").write_text("yes")

main()
"""


def test_a_stage_run_as_the_wrong_user_fails_before_any_work_naming_the_fix(
    mlflow_on_postgres: tuple[str, Path], tmp_path: Path
) -> None:
    uri, _ = mlflow_on_postgres
    reader = ("bob", f"reader/{uuid.uuid4().hex}")
    add_user(uri, *reader)
    (tmp_path / "stage.py").write_text(OWN_STAGE)
    pipeline = pipeline_credentials()

    def stage(user: str | None, password: str = "") -> subprocess.CompletedProcess:
        (tmp_path / "trained").unlink(missing_ok=True)
        env = e2e_env(REPO, MLFLOW_TRACKING_URI=uri, MLFLOW_EXPERIMENT_NAME="pipeline-owned")
        for key in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
            env.pop(key, None)
        if user:
            env.update(MLFLOW_TRACKING_USERNAME=user, MLFLOW_TRACKING_PASSWORD=password)
        return subprocess.run([sys.executable, "stage.py"], cwd=tmp_path, env=env, text=True,
                              capture_output=True, timeout=300)

    done = stage("pipeline", pipeline["MLFLOW_TRACKING_PASSWORD"])  # creates its experiment
    assert done.returncode == 0 and (tmp_path / "trained").exists(), done.stderr[-3000:]
    for user, password, said in [
        (None, "", "refused no user (MLFLOW_TRACKING_USERNAME is not set) (HTTP 401): set "
                   "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD"),
        ("bob", "wrong", "refused user 'bob' (HTTP 401)"),
        ("bob", reader[1], "refused stage 'toy' an operation as user 'bob'"),
    ]:
        done = stage(user, password)
        assert done.returncode == 2 and said in done.stderr, done.stderr[-3000:]
        assert "Traceback" not in done.stderr and not (tmp_path / "trained").exists()



def test_a_champion_rewritten_through_the_artifact_proxy_is_refused_at_load_naming_the_files(
    mlflow_on_postgres: tuple[str, Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """tasks/register/manifest.py on the real server, as the pipeline user: it rewrites any stored
    file, but not the manifest's param (not even across a delete and restore)."""
    import importlib.metadata

    import mlflow
    from mlflow.exceptions import MlflowException
    from mlflow.store.artifact.artifact_repository_registry import _artifact_repository_registry as repos

    from tasks.register.manifest import MANIFEST_PARAM, ManifestMismatch, model_key
    from tasks.register.registry import champion_of
    from tests.register.manifest_model import entry_point_path, register_echo, rewrite, verifying

    uri, _ = mlflow_on_postgres
    model = compose_env("mlflow-init")["REGISTERED_MODEL"]
    pipeline = pipeline_client(uri, monkeypatch)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    mv, stored = register_echo(tmp_path, model, pipeline.create_experiment(f"manifest-{uuid.uuid4().hex[:8]}"))
    for file in ("model_code.py", "artifacts/weights.safetensors", "MLmodel"):
        rewrite(stored, file, b"rewritten\n", tmp_path / "rw" / file)
    found = importlib.metadata.distributions(path=[str(entry_point_path(tmp_path))])
    (point,) = [e for d in found for e in d.entry_points if e.group == "mlflow.artifact_repository"]
    with verifying():  # MLflow's `models:/` resolver as pyproject's entry point gives it once installed
        repos.register(point.name, point.load())
        named = r"MLmodel differs [^;]+; artifacts/weights.safetensors differs [^;]+; model_code.py differs [^;]+\. The"
        with pytest.raises(ManifestMismatch, match=rf"version {mv.version}: refusing to load it: {named}"):
            mlflow.pyfunc.load_model(f"models:/{model}@champion")
    pipeline.log_dict(mv.run_id, {"metrics": {"dino": 9.0}, "model": {"source": mv.source}}, "lineage.json")
    assert "rewritten after registration" in champion_of(pipeline, mv, "dino").note
    key = MANIFEST_PARAM.format(model_key(mv.source))
    digest = pipeline.get_run(mv.run_id).data.params[key]
    with pytest.raises(MlflowException, match="Changing param values is not allowed"):
        pipeline.log_param(mv.run_id, key, "0" * 64)
    pipeline.delete_run(mv.run_id)  # the pipeline made the experiment: it may delete its runs
    with pytest.raises(MlflowException, match="must be in the 'active' state"):
        pipeline.log_param(mv.run_id, key, "0" * 64)
    pipeline.restore_run(mv.run_id)
    assert pipeline.get_run(mv.run_id).data.params[key] == digest


#: `make serve-model`'s recipe (Makefile): the entry the test below runs, as the Makefile runs it.
SERVE_MODEL = '-m tasks.register.verified models serve -m "$$model" --env-manager local -h 127.0.0.1 -p $(PORT)'


def test_a_version_registered_without_a_manifest_is_served_or_rescored_only_when_allowed(
    mlflow_on_postgres: tuple[str, Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """tasks/register/manifest.py's FINETUNE_ALLOW_UNVERIFIED on the real server: a version the
    pipeline user registered without a manifest (by other code) is refused by `make serve-model`'s
    entry, run by a reader, and by the flow's re-score, both naming the setting; with it set to 1,
    the same command serves the version and the re-score gets past the check."""
    from flows.rescore import attempt
    from tasks.register.manifest import ALLOW_ENV
    from tests.register.http_serve import post, wait_ready
    from tests.register.manifest_model import register_echo

    assert SERVE_MODEL in (REPO / "Makefile").read_text(), "make serve-model runs another entry now"
    uri, _ = mlflow_on_postgres
    model = compose_env("mlflow-init")["REGISTERED_MODEL"]
    reader = ("erin", f"reader/{uuid.uuid4().hex}")
    access_tool(monkeypatch, uri, "add-user", reader[0], stdin=reader[1])
    pipeline = pipeline_client(uri, monkeypatch)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    experiment = pipeline.create_experiment(f"unverified-{uuid.uuid4().hex[:8]}")
    mv, _ = register_echo(tmp_path, model, experiment, manifested=False)
    model_uri = f"models:/{model}/{mv.version}"
    env = e2e_env(REPO, MLFLOW_TRACKING_URI=uri, MLFLOW_TRACKING_USERNAME=reader[0],
                  MLFLOW_TRACKING_PASSWORD=reader[1])
    env.pop(ALLOW_ENV, None)

    def serve(port: int) -> list[str]:
        return [sys.executable, "-m", "tasks.register.verified", "models", "serve", "-m", model_uri,
                "--env-manager", "local", "-h", "127.0.0.1", "-p", str(port)]

    log, url = tmp_path / "serve.log", f"http://127.0.0.1:{free_port()}"
    with open(log, "wb") as sink:  # allowed, while the same command without the setting is refused
        server = subprocess.Popen(serve(int(url.rsplit(":", 1)[1])), cwd=tmp_path, env={**env, ALLOW_ENV: "1"},
                                  stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        refused = subprocess.run(serve(free_port()), cwd=tmp_path, env=env, capture_output=True, text=True,
                                 timeout=120)
        wait_ready(url, server, log, timeout=120)
        assert post(url, {"inputs": ["a"]}, timeout=60) == (200, {"predictions": ["w1:a"]})
    finally:
        stop_process_group(server)
    assert refused.returncode == 2, refused.stdout[-3000:] + refused.stderr[-3000:]
    assert f"registered model {model} version {mv.version} was registered without a manifest" in refused.stderr
    assert f"set {ALLOW_ENV}=1 to load it unchecked" in refused.stderr and "Traceback" not in refused.stderr
    assert f"loading it unchecked ({ALLOW_ENV}=1)" in log.read_text()

    # the flow's re-score (as the pipeline): refused before any file is used, so the champion holds
    held = attempt(tmp_path, mv.version, model_uri, {}, timeout_s=60)
    assert "registered without a manifest" in held["error"] and f"{ALLOW_ENV}=1" in held["error"]
    monkeypatch.setenv(ALLOW_ENV, "1")
    past = attempt(tmp_path, mv.version, model_uri, {}, timeout_s=60)  # an echo model has no fine-tune
    assert past["error"] == f"{model_uri} has no fine-tuned model to re-score (artifacts/finetuned)"


def test_each_database_role_connects_only_to_its_own_databases(postgres: Postgres) -> None:
    """infra/postgres/init.sh: `mlflow` owns `mlflow` and `mlflow_auth`, `prefect` owns `prefect`,
    PUBLIC's CONNECT revoked; a password is asked of everyone (scram-sha-256), even on loopback."""
    import asyncio

    import asyncpg

    passwords = {role: compose_env("postgres")[f"{role.upper()}_DB_PASSWORD"] for role in ("mlflow", "prefect")}

    async def connect(user: str, password: str | None, database: str) -> str:
        try:
            conn = await asyncpg.connect(host="127.0.0.1", port=postgres.port, user=user, password=password,
                                         database=database, timeout=30)
        except (asyncpg.PostgresError, asyncpg.InterfaceError) as err:
            return type(err).__name__
        await conn.close()
        return "connected"

    async def attempts() -> dict[tuple[str, str], str]:
        return {(user, db): await connect(user, passwords[user], db)
                for user in passwords for db in ("mlflow", "mlflow_auth", "prefect")}

    assert asyncio.run(attempts()) == {
        ("mlflow", "mlflow"): "connected", ("mlflow", "mlflow_auth"): "connected",
        ("mlflow", "prefect"): "InsufficientPrivilegeError",
        ("prefect", "mlflow"): "InsufficientPrivilegeError", ("prefect", "mlflow_auth"): "InsufficientPrivilegeError",
        ("prefect", "prefect"): "connected"}
    refused = asyncio.run(connect("mlflow", "wrong", "mlflow")), asyncio.run(connect("mlflow", None, "mlflow"))
    assert refused == ("InvalidPasswordError", "InvalidPasswordError")


def test_the_pipeline_ends_the_runs_a_stopped_rescore_left_running(
    mlflow_on_postgres: tuple[str, Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """flows/rescore.py `close_runs` on the real server, as the flow's pipeline user: the runs tagged
    with the stopped re-score's id are ended, another re-score's run is left alone
    (the command itself: tests/register/test_rescore_fails.py)."""
    import json

    from flows.rescore import RUN_CONTEXT_ENV, close_runs, tagged

    uri, _ = mlflow_on_postgres
    pipeline = pipeline_client(uri, monkeypatch)
    experiment = pipeline.create_experiment(f"rescore-{uuid.uuid4().hex[:8]}")
    stopped, other = (tagged({"MLFLOW_TRACKING_URI": uri}, uuid.uuid4().hex) for _ in range(2))
    left, running = (pipeline.create_run(experiment, tags=json.loads(env[RUN_CONTEXT_ENV])).info.run_id
                     for env in (stopped, other))
    assert close_runs(stopped, tmp_path, "KILLED", "re-scoring stopped after 5 s") == [left]
    assert pipeline.get_run(left).info.status == "KILLED"
    assert pipeline.get_run(left).data.tags["error"] == "re-scoring stopped after 5 s"
    assert pipeline.get_run(running).info.status == "RUNNING"
