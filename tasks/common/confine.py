"""A stage's process with only its credentials (`confine`), and a stage that holds no MLflow
credentials recorded on a tracking server all the same (`run_relayed`).

`confine(stage)` is the first call of every stage's `main()`: see tasks/common/credentials.py for
the table and why the stage's own entry is where stripping happens.

ingest parses untrusted files and class_images runs under launchers; neither is given the MLflow
password (tasks/common/credentials.py). A stage that logs no run (`LOGS_NO_RUN`: data_manifest) is
only re-executed with its row, never relayed. When the tracking URI is an http(s) server, the stage runs
as a child of this process under its stripped environment, logging to a throw-away local store
(SQLite, artifacts beside it); this process, which holds the credentials and runs no stage code,
checks the server before the child starts (nothing runs without a record) and copies the child's
run to the server after it ends: tags (the flow's parent run included), params, every metric's
history, artifacts, status and times. The run id on the server is a new one. The artifacts copied
are the run's own folder of the child's store, never the folder its `artifact_uri` names, plain
files only, capped (tasks/common/relay_artifacts.py); a refusal is said in one line and tagged
`relay.refused` on the server's run.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from tasks.common import relay_artifacts
from tasks.common.credentials import LOGS_NO_RUN, MLFLOW, allowed, stage_environ
from tasks.common.errors import UserError
from tasks.common.stop_signals import relay
from tasks.common.tracking import experiment_name, tracking_uri, wait_for_server

BATCH = 100  # MLflow's cap on params per log_batch; metrics go 1000 at a time
#: the relayed run's tag saying why its artifacts (or its artifact_uri) were refused
RELAY_REFUSED_TAG = "relay.refused"


def confine(stage: str) -> None:
    """Make this process hold only `stage`'s credentials (see the module's docstring). Returns at
    once when it already does; otherwise re-executes the stage or relays its run, never returning."""
    env = stage_environ(stage)
    if env.keys() == os.environ.keys():
        return
    remote = tracking_uri().startswith(("http://", "https://")) and stage not in LOGS_NO_RUN
    if remote and any(os.environ.get(k) for k in MLFLOW) and not set(MLFLOW) & set(allowed(stage)):
        sys.exit(run_relayed(stage, list(sys.orig_argv), env))
    os.execve(sys.executable, list(sys.orig_argv), env)


def run_relayed(stage: str, argv: list[str], env: dict[str, str]) -> int:
    """Run `argv` under `env` with a local MLflow store, then copy its runs to our tracking
    server. Returns the child's exit code (128 + signal when a signal ended it)."""
    from mlflow import MlflowClient

    server = tracking_uri()
    wait_for_server(server)  # with this process's credentials: the copy will be accepted
    store = Path(tempfile.mkdtemp(prefix=f"finetune-{stage}-mlflow-"))
    local = f"sqlite:///{store / 'mlflow.db'}"
    MlflowClient(local).create_experiment(experiment_name(), (store / "artifacts").as_uri())
    # a group of its own: a stop request reaches it once, through `relay`
    proc = subprocess.Popen(argv, executable=sys.executable, env={**env, "MLFLOW_TRACKING_URI": local},
                            process_group=0)
    relay(proc, {})
    code = proc.wait()
    try:
        copied = copy_runs(MlflowClient(local), MlflowClient(server), store)
    except Exception as err:
        raise UserError(
            f"stage '{stage}' ended (exit {code}) but its MLflow run could not be copied to {server}: "
            f"{err}. The run is kept in {local}; copy it once the server answers, or rerun the stage"
        ) from None
    print(f"{stage}: MLflow run(s) {', '.join(copied) or 'none'} recorded at {server} "
          "(relayed: the stage held no MLflow credentials)", file=sys.stderr, flush=True)
    shutil.rmtree(store, ignore_errors=True)
    return 128 + signal.Signals(-code).value if code < 0 else code


def copy_runs(src: Any, dst: Any, store: Path) -> list[str]:
    """Copy every run of `src`'s experiment into `dst`'s experiment of the same name; the new ids.
    `store`: the child's store folder, where each run's artifacts are read (relay_artifacts.py)."""
    name = experiment_name()
    source = src.get_experiment_by_name(name)
    target = dst.get_experiment_by_name(name)
    target_id = target.experiment_id if target is not None else dst.create_experiment(name)
    runs = src.search_runs([source.experiment_id], order_by=["attributes.start_time ASC"])
    limit = relay_artifacts.max_bytes()
    return [copy_run(src, dst, run, target_id, store, limit) for run in runs]


def copy_run(src: Any, dst: Any, run: Any, experiment_id: str, store: Path,
             limit: int = relay_artifacts.DEFAULT_MAX_BYTES) -> str:
    from mlflow.entities import Metric, Param

    new = dst.create_run(experiment_id, start_time=run.info.start_time, tags=run.data.tags,
                         run_name=run.info.run_name)
    new_id = new.info.run_id
    params = [Param(k, v) for k, v in run.data.params.items()]
    for i in range(0, len(params), BATCH):
        dst.log_batch(new_id, params=params[i : i + BATCH])
    metrics = [Metric(m.key, m.value, m.timestamp, m.step)
               for key in run.data.metrics for m in src.get_metric_history(run.info.run_id, key)]
    for i in range(0, len(metrics), 10 * BATCH):
        dst.log_batch(new_id, metrics=metrics[i : i + 10 * BATCH])
    copy_artifacts(dst, run, new_id, store, limit)
    # a run still RUNNING was cut short (the child killed): it ends KILLED on the server
    status = "KILLED" if run.info.status == "RUNNING" else run.info.status
    dst.set_terminated(new_id, status=status, end_time=run.info.end_time)
    return new_id


def copy_artifacts(dst: Any, run: Any, new_id: str, store: Path, limit: int) -> None:
    """Upload run's own artifacts folder of `store` (never the folder its `artifact_uri` names) to
    run `new_id`; a refusal is said in one line on stderr and in the new run's tag RELAY_REFUSED_TAG."""
    run_id = run.info.run_id
    own = relay_artifacts.own_folder(store, run_id)
    if run.info.artifact_uri.rstrip("/") != own.as_uri():
        _refused(dst, new_id, f"run {run_id}'s artifact_uri names {run.info.artifact_uri}, not its own folder "
                              f"{own}: ignored, only {own} is copied")
    with tempfile.TemporaryDirectory(prefix="finetune-relay-") as staged:
        try:
            if not relay_artifacts.stage(store, run_id, Path(staged), limit):
                return
        except relay_artifacts.Refused as err:
            _refused(dst, new_id, str(err))
            return
        if any(Path(staged).iterdir()):
            dst.log_artifacts(new_id, staged)


def _refused(dst: Any, new_id: str, reason: str) -> None:
    print(f"relay: {reason}", file=sys.stderr, flush=True)
    dst.set_tag(new_id, RELAY_REFUSED_TAG, reason[:5000])
