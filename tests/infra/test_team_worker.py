"""The team set-up end to end, on the stack of tests/infra/test_team_stack.py (PostgreSQL, the
Prefect and MLflow servers with compose's command lines) and a DVC remote (a local folder standing
in for MinIO), with two clones of the repository as two machines and the real pipeline at small
settings:

1. Machine A, as a team sets it up: the data folder tracked with `dvc add`, a default DVC remote;
   compose's worker command (`python -m flows.serve --attach`) deploys prefect.yaml and starts a
   process worker there, and `prefect deployment run finetune/main` runs the pipeline. The MLflow server is killed while
   the registration uploads the model: the run fails with a message naming the server, and
   PostgreSQL holds no model version and no alias.
2. The server restarted on the same database, the deployment runs again: every stage is skipped,
   the model is registered with the remote named on the version (`dvc.remote`), `champion` moves,
   and a second process loads `models:/<name>@champion` through the server and generates.
3. Machine B, a clone with A's dvc.lock and an empty DVC cache: the nightly check says up to date
   (data only missing there is no change; v1's fingerprint tag, forged, is named and not
   believed: the lineage document is read); the flow pulls every stage's outputs from the remote
   instead of running any, `dvc status` is clean (but for the data manifest, always rewritten), and
   the version it registers has the same lineage fingerprint as A's.
4. No password of the stack in a log, a database, an artifact, a checkout or a command line.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from tests.e2e_util import copy_repo, e2e_env, free_port, stop_process_group
from tests.infra.stack import (
    COMPOSE,
    SECRETS,
    CommandLineWatch,
    Postgres,
    compose_env,
    leaked_secrets,
    needs_psycopg2,
    pipeline_client,
    pipeline_credentials,
    start_mlflow,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

STAGES = ["base", "ingest", "class_images", "train", "export", "evaluate"]
#: The point is the chain, not the images.
SMALL = {
    "class_images": {"num_images": 2, "batch_size": 2, "num_inference_steps": 2},
    "train": {"max_train_steps": 2, "train_batch_size": 1, "num_validation_images": 1,
              "validation_inference_steps": 2},
    "export": {"parity": {"num_inference_steps": 2}, "latency_dynamic": False},
    "evaluate": {"images_per_prompt": 1, "num_inference_steps": 2, "max_prompts": 1,
                 "drift": {"images_per_prompt": 1}},
}
#: A short MLflow retry budget, so that the dead server is given up on in seconds (compose's
#: worker keeps MLflow's default budget of minutes, made for a restarting server).
SHORT_RETRIES = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                 "MLFLOW_HTTP_REQUEST_TIMEOUT": "30", "FINETUNE_MLFLOW_WAIT_S": "10"}
GIT = ["git", "-c", "user.name=team", "-c", "user.email=team@localhost"]

LOAD = """
import mlflow, sys
model = mlflow.pyfunc.load_model(sys.argv[1])
out = model.predict(["a photo of sks toy"], params={"num_inference_steps": 2, "seed": 1})
print(len(out), out.iloc[0]["image"][:8])
"""


def run(root: Path, *command: str, env: dict[str, str] | None = None,
        timeout: float = 600) -> str:
    proc = subprocess.run(list(command), cwd=root, env=env or e2e_env(root), capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"{command}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    return proc.stdout + proc.stderr


def small_params(root: Path) -> str:
    params = yaml.safe_load((root / "params.yaml").read_text())
    for section, values in SMALL.items():
        for key, value in values.items():
            if isinstance(value, dict):
                params[section][key].update(value)
            else:
                params[section][key] = value
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    from tasks.register.naming import planned

    return planned(root / "params.yaml", None, None) or "unknown"  # the name a run registers under


def team_setup(root: Path, remote: Path) -> str:
    """What a team does once (infra/README.md, "Shared data and models"): the data folder under
    DVC, a default remote, both committed. Returns the model's name."""
    name = small_params(root)
    data_dir = yaml.safe_load((root / "params.yaml").read_text())["ingest"]["data_dir"]
    run(root, sys.executable, "-m", "dvc", "add", "-q", data_dir)
    run(root, sys.executable, "-m", "dvc", "remote", "add", "-d", "team", str(remote))
    run(root, sys.executable, "-m", "dvc", "remote", "modify", "team", "verify", "true")
    run(root, "git", "add", "-A")
    run(root, *GIT, "commit", "-q", "-m", "team set-up")
    return name


def worker_env(root: Path, api: str, uri: str) -> dict[str, str]:
    """compose's worker environment (its credentials: MLflow's `pipeline` user and Prefect's auth
    string; less MinIO's), with this stack's addresses and the short retry budget."""
    env = e2e_env(root, **compose_env("worker"))
    env.update(PREFECT_API_URL=api, MLFLOW_TRACKING_URI=uri, PREFECT_CLI_PROMPT="false",
               PREFECT_WORKER_QUERY_SECONDS="2", **SHORT_RETRIES)
    env.pop("PREFECT_UI_API_URL", None)
    return env


@dataclass
class Team:
    postgres: Postgres
    a: Path
    remote: Path
    model: str
    api: str
    env: dict[str, str]
    mlflow_home: Path
    mlflow_port: int
    mlflow: subprocess.Popen
    worker_log: Path
    watch: CommandLineWatch
    timings: dict[str, float] = field(default_factory=dict)
    clones: list[Path] = field(default_factory=list)  # other machines' checkouts

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.mlflow_port}"

    def deployment_run(self, **popen) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "prefect", "deployment", "run",
                                 "finetune/main", "--watch"], cwd=self.a, env=self.env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **popen)


@pytest.fixture(scope="module")
def team(postgres: Postgres, prefect_on_postgres: str,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Team]:
    needs_psycopg2()
    start = time.monotonic()
    a = copy_repo(tmp_path_factory.mktemp("machine-a"))
    remote = tmp_path_factory.mktemp("dvc-remote")
    model = team_setup(a, remote)
    home, port = tmp_path_factory.mktemp("mlflow-team"), free_port()
    server = start_mlflow(postgres, home, port)
    env = worker_env(a, prefect_on_postgres, f"http://127.0.0.1:{port}")
    # compose's worker command, run in the checkout as compose runs it in /workspace.
    log = a.parent / "worker.log"
    with log.open("w") as sink:
        worker = subprocess.Popen(COMPOSE["services"]["worker"]["command"], shell=True, cwd=a,
                                  env=env, stdout=sink, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    watch = CommandLineWatch().start()
    team = Team(postgres, a, remote, model, prefect_on_postgres, env, home, port, server, log,
                watch)
    try:
        deadline = time.monotonic() + 300
        while "started!" not in log.read_text():  # flows.serve deployed, then started the worker
            assert worker.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(1)
        team.timings["set-up"] = time.monotonic() - start
        yield team
    finally:
        watch.stop()
        stop_process_group(worker)
        if team.mlflow.poll() is None:
            stop_process_group(team.mlflow)
        print(f"\nteam worker timings (s): {json.dumps({k: round(v, 1) for k, v in team.timings.items()})}")


def _model_files(artifacts: Path) -> list[Path]:
    """Files of a logged model (`<experiment>/models/m-<id>/artifacts/...`) under the server's
    artifact folder: what the registration uploads first."""
    return [p for p in artifacts.rglob("*") if p.is_file() and "models" in p.parts
            and any(part.startswith("m-") for part in p.parts)]


def test_a_registration_cut_off_by_a_dead_server_leaves_nothing_registered(team: Team) -> None:
    start = time.monotonic()
    watch = team.deployment_run()
    deadline = start + 1500
    while not _model_files(team.mlflow_home / "artifacts"):
        assert watch.poll() is None and time.monotonic() < deadline, \
            (watch.communicate()[0] or "")[-3000:] + team.worker_log.read_text()[-5000:]
        time.sleep(0.05)
    os.killpg(team.mlflow.pid, signal.SIGKILL)  # the server dies mid-upload
    team.mlflow.wait()
    killed = time.monotonic()
    team.timings["run 1 until the kill"] = killed - start
    out = watch.communicate(timeout=600)[0]
    team.timings["kill to failed run"] = time.monotonic() - killed
    log = team.worker_log.read_text()
    assert watch.returncode != 0 and "Failed" in out, out[-3000:]
    assert f"registration stopped: the MLflow tracking server {team.uri} stopped answering" in log
    assert "Nothing was registered" in log
    assert team.postgres.query("mlflow", "select count(*) from model_versions") == [(0,)]
    assert team.postgres.query("mlflow", "select count(*) from registered_model_aliases") == [(0,)]
    # The stages finished and were pushed before the registration began.
    assert all(f"stage '{s}' ran" in log or f"Running stage '{s}'" in log for s in STAGES)
    assert "dvc push:" in log


def test_the_rerun_registers_moves_champion_and_loads_in_another_process(
        team: Team, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:

    team.mlflow = start_mlflow(team.postgres, team.mlflow_home, team.mlflow_port,
                               bootstrap=False)  # restarted on the same databases
    start = time.monotonic()
    watch = team.deployment_run()
    out = watch.communicate(timeout=900)[0]
    team.timings["run 2 (stages skipped, registration)"] = time.monotonic() - start
    assert watch.returncode == 0, out[-3000:] + team.worker_log.read_text()[-5000:]
    gate = json.loads((team.a / "reports/evaluate.json").read_text())["gate"]
    assert gate["passed"], gate  # the demo's gate passes a healthy model: champion must move

    client = pipeline_client(team.uri, monkeypatch)
    v1 = client.get_model_version_by_alias(team.model, "champion")
    assert str(v1.version) == "1" and set(v1.aliases) == {"candidate", "champion"}
    assert v1.tags["dvc.remote"] == f"team {team.remote}"
    parent = client.get_run(v1.run_id)
    assert parent.data.tags["stages.skipped"] == ",".join(STAGES)
    assert team.postgres.query(
        "mlflow", f"select version from registered_model_aliases where name = '{team.model}' "
                  "and alias = 'champion'") == [(1,)]

    start = time.monotonic()
    script = tmp_path / "load.py"
    script.write_text(LOAD)
    printed = run(tmp_path, sys.executable, str(script), f"models:/{team.model}@champion",
                  env=e2e_env(team.a, MLFLOW_TRACKING_URI=team.uri, **pipeline_credentials()))
    team.timings["load + predict in a second process"] = time.monotonic() - start
    assert "1 iVBORw0K" in printed.splitlines()  # one base64 PNG


def test_a_second_machine_pulls_what_it_needs_and_registers_the_same_model(
        team: Team, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:

    # The team shares the run's dvc.lock through git; machine B clones it, with no DVC cache.
    run(team.a, "git", "add", "-A")
    run(team.a, *GIT, "commit", "-q", "-m", "pipeline run")
    b = tmp_path / "machine-b"
    team.clones.append(b)
    run(tmp_path, "git", "clone", "-q", str(team.a), str(b))
    assert not (b / "models").exists() and not (b / "data/demo/subject").exists()
    env = {**e2e_env(b, PREFECT_API_URL=team.api, MLFLOW_TRACKING_URI=team.uri,
                     **pipeline_credentials()), **SHORT_RETRIES}

    # Whoever may tag versions (the pipeline's user) forges v1's fingerprint tag: the check reads
    # the lineage document, still finds nothing changed, and names the forged tag.
    client = pipeline_client(team.uri, monkeypatch)
    built_from = client.get_model_version(team.model, "1").tags["lineage.fingerprint"]
    client.set_model_version_tag(team.model, "1", "lineage.fingerprint", "0000forged")
    start = time.monotonic()
    nightly = run(b, sys.executable, "-m", "flows.finetune", "--only-if-changed", env=env)
    team.timings["machine B: nightly check"] = time.monotonic() - start
    assert f"up to date: nothing changed since {team.model} v1" in nightly
    assert "lineage.fingerprint=0000forged disagrees" in nightly, nightly[-2000:]

    start = time.monotonic()
    run(b, sys.executable, "-m", "flows.finetune", env=env)
    team.timings["machine B: flow run (pull, registration)"] = time.monotonic() - start
    v1 = client.get_model_version(team.model, "1")
    v2 = client.get_model_version_by_alias(team.model, "candidate")
    assert str(v2.version) == "2"
    parent = client.get_run(v2.run_id)
    assert [parent.data.tags[f"stage.{s}"] for s in STAGES] == ["pulled"] * len(STAGES)
    assert v2.tags["lineage.fingerprint"] == built_from
    assert v2.tags["dvc.remote"] == v1.tags["dvc.remote"]
    assert "champion" not in v2.aliases  # the same model does not beat itself
    status = subprocess.run([sys.executable, "-m", "dvc", "status", "--json"], cwd=b, env=env,
                            capture_output=True, text=True).stdout
    assert json.loads(status) == {"data_manifest": ["always changed"]}  # the data folder's manifest, always rewritten
    subject = sorted(p.name for p in (team.a / "data/demo/subject").iterdir())
    assert sorted(p.name for p in (b / "data/demo/subject").iterdir()) == subject


def test_no_credential_in_a_log_a_record_or_a_command_line(team: Team) -> None:
    """After the runs above (a failed one, a registration, a second machine): none of the stack's
    passwords is in the worker's log, MLflow's or Prefect's databases (params, tags, logs,
    artifacts' metadata, flow run parameters), the artifact store, the checkouts, or any process's
    command line seen while they ran. The search is shown to find a planted one first."""
    planted = SECRETS["MLFLOW_PIPELINE_PASSWORD"]
    canary = subprocess.Popen(["sh", "-c", "sleep 2", planted])
    canary.wait()
    team.watch.stop()
    seen = {line for line in team.watch.found if "sleep 2" in line}
    assert seen and planted in seen.pop(), "the command-line watch missed a planted password"
    with tempfile.TemporaryDirectory() as elsewhere:
        (Path(elsewhere) / "planted.log").write_text(f"password={planted}\n")
        assert leaked_secrets(team.postgres, [Path(elsewhere)]) == {
            "MLFLOW_PIPELINE_PASSWORD": [f"{elsewhere}/planted.log"]}

    leaks = leaked_secrets(team.postgres, [team.worker_log, team.mlflow_home, team.a,
                                           *team.clones])
    assert team.watch.samples > 100, "the command lines were hardly sampled"
    assert not leaks, f"secrets found: {leaks}"
    others = {line for line in team.watch.found if "sleep 2" not in line}
    assert not others, f"secrets on command lines: {others}"
