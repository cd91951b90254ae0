"""MLflow behind one small service, so stages log the same way and tests can point it anywhere.

- Tracking URI: `MLFLOW_TRACKING_URI` if set, else `sqlite:///mlflow.db` at the repository root.
- Experiment: `MLFLOW_EXPERIMENT_NAME` if set, else `finetune`.
- A stage started by the flow finds the flow's parent run id in `FINETUNE_PARENT_RUN_ID` and logs
  as its child; a stage run by plain `dvc repro` logs as a top-level run of its own.
- A tracking server (http/https URI) that does not answer when a stage starts is waited for, up to
  `FINETUNE_MLFLOW_WAIT_S` seconds (default 60: a server restarting or briefly unreachable); then
  the stage fails with a clear message before doing any work, so nothing is ever trained without
  a record. Once a run is open, MLflow's own HTTP retries (MLFLOW_HTTP_REQUEST_MAX_RETRIES, with
  backoff) cover a short outage; a server still gone after them fails the stage with a message
  naming the server and the run (no traceback).
"""
from __future__ import annotations

import logging
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tasks.common.credentials import redact_params

log = logging.getLogger(__name__)

PARENT_ENV = "FINETUNE_PARENT_RUN_ID"
DEFAULT_EXPERIMENT = "finetune"
SERVER_WAIT_ENV = "FINETUNE_MLFLOW_WAIT_S"
DEFAULT_SERVER_WAIT_S = 60.0


def tracking_uri(root: Path | None = None) -> str:
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    root = (root or Path.cwd()).resolve()
    return f"sqlite:///{root / 'mlflow.db'}"


def experiment_name() -> str:
    return os.environ.get("MLFLOW_EXPERIMENT_NAME", DEFAULT_EXPERIMENT)


def git_commit(root: Path | None = None) -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root or Path.cwd(), capture_output=True, text=True, check=True
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1}, for logging nested configs as MLflow params."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def server_wait_seconds() -> float:
    from tasks.common.errors import UserError

    raw = os.environ.get(SERVER_WAIT_ENV, str(DEFAULT_SERVER_WAIT_S))
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value < 0:
        raise UserError(f"{SERVER_WAIT_ENV}={raw!r}: expected seconds >= 0, e.g. {SERVER_WAIT_ENV}=60")
    return value


def wait_for_server(uri: str | None = None, timeout: float | None = None) -> float:
    """Bounded wait for an http(s) tracking server's /health; returns the seconds waited.

    A local store (sqlite, file) needs no server and returns at once. Past the bound, raises a
    UserError naming the server, the last error and the fixes.
    """
    from tasks.common.errors import UserError

    uri = uri or tracking_uri()
    if not uri.startswith(("http://", "https://")):
        return 0.0
    timeout = server_wait_seconds() if timeout is None else timeout
    start = time.monotonic()
    last = "no answer"
    announced = False
    while True:
        try:
            with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=5) as resp:
                if resp.status == 200:
                    check_credentials(uri)
                    return time.monotonic() - start
                last = f"HTTP {resp.status}"
        except urllib.error.HTTPError as err:
            last = f"HTTP {err.code}"
        except (urllib.error.URLError, OSError) as err:
            last = str(getattr(err, "reason", err))
        waited = time.monotonic() - start
        if waited >= timeout:
            raise UserError(
                f"the MLflow tracking server {uri} did not answer within {timeout:.0f} s "
                f"(last error: {last}). The stage did not start, so nothing ran without a record. "
                f"Start the server (infra/README.md), check MLFLOW_TRACKING_URI, or wait longer "
                f"with {SERVER_WAIT_ENV}=<seconds>"
            )
        if not announced:
            log.warning("MLflow server %s not answering (%s); waiting up to %.0f s", uri, last,
                        timeout)
            announced = True
        time.sleep(min(2.0, max(0.0, timeout - waited)))


def _user() -> str:
    user = os.environ.get("MLFLOW_TRACKING_USERNAME")
    return f"user '{user}'" if user else "no user (MLFLOW_TRACKING_USERNAME is not set)"


def check_credentials(uri: str) -> None:
    """A UserError, before any work, when the server asks for a user this process does not give
    (MLflow's basic-auth app: infra/README.md, "Users and permissions")."""
    from mlflow.exceptions import MlflowException
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import http_request

    from tasks.common.errors import UserError

    try:  # MLflow's own client request: the credentials as every later request sends them
        response = http_request(get_default_host_creds(uri), "/api/2.0/mlflow/experiments/search",
                                "GET", params={"max_results": 1}, max_retries=0, timeout=10,
                                raise_on_status=False)
    except MlflowException:
        return  # an outage is for the caller's bounded wait and the run's own retries
    if response.status_code == 401:
        raise UserError(
            f"the MLflow tracking server {uri} refused {_user()} (HTTP 401): set "
            "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD to a user of that server "
            "(its admin adds one: infra/README.md, \"Users and permissions\"). Nothing ran"
        ) from None


def access_refused(err: Exception, stage: str) -> None:
    """A UserError when the server refused this user an operation (HTTP 403)."""
    from tasks.common.errors import UserError

    if getattr(err, "error_code", None) != "PERMISSION_DENIED":
        return
    raise UserError(
        f"the MLflow tracking server {tracking_uri()} refused stage '{stage}' an operation as "
        f"{_user()} ({err}). The pipeline's user needs EDIT on its experiment and registered "
        "model: ask the server's admin (infra/README.md, \"Users and permissions\"), or run as "
        "the pipeline's user"
    ) from None


def configure() -> None:
    """Point the MLflow client at this project's tracking URI and experiment."""
    import mlflow

    mlflow.set_tracking_uri(tracking_uri())
    mlflow.set_experiment(experiment_name())


class StageRun:
    """Thin handle over an active MLflow run; the only MLflow surface stages use."""

    def __init__(self, run: Any) -> None:
        self._run = run
        self.run_id: str = run.info.run_id

    def log_params(self, params: Mapping[str, Any], prefix: str = "") -> None:
        import mlflow

        items = list(redact_params(flatten(params, prefix)).items())
        for i in range(0, len(items), 100):  # MLflow caps a batch at 100 params
            mlflow.log_params({k: ("" if v is None else str(v)[:6000]) for k, v in items[i : i + 100]})

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        import mlflow

        mlflow.log_metrics({k: float(v) for k, v in metrics.items()}, step=step)

    def log_artifact(self, path: Path | str, artifact_path: str | None = None) -> None:
        import mlflow

        path = Path(path)
        if path.is_dir():
            mlflow.log_artifacts(str(path), artifact_path=artifact_path)
        else:
            mlflow.log_artifact(str(path), artifact_path=artifact_path)

    def log_image(self, image: Any, name: str) -> None:
        import mlflow

        mlflow.log_image(image, artifact_file=name)

    def log_dict(self, data: Mapping[str, Any], name: str) -> None:
        import mlflow

        mlflow.log_dict(dict(data), name)

    def log_table(self, rows: list[dict[str, Any]], name: str) -> None:
        import mlflow

        columns: dict[str, list[Any]] = {}
        for row in rows:
            for key in row:
                columns.setdefault(key, [])
        for row in rows:
            for key in columns:
                columns[key].append(row.get(key))
        mlflow.log_table(data=columns, artifact_file=name)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        import mlflow

        mlflow.set_tags({k: str(v) for k, v in tags.items()})


@contextmanager
def stage_run(stage: str, params: Mapping[str, Any] | None = None) -> Iterator[StageRun]:
    """Start the MLflow run of one stage (child of the flow's run when there is one).

    The run ends FINISHED on success and FAILED when the body raises.
    """
    import mlflow
    from mlflow.exceptions import MlflowException

    wait_for_server()  # before any work: never train without a record
    try:
        configure()
    except MlflowException as err:
        access_refused(err, stage)
        raise
    tags = {"stage": stage}
    parent = os.environ.get(PARENT_ENV)
    if parent:
        tags["mlflow.parentRunId"] = parent
    commit = git_commit()
    if commit:
        tags["mlflow.source.git.commit"] = commit
    run_id = None
    try:
        with mlflow.start_run(run_name=stage, tags=tags) as run:
            run_id = run.info.run_id
            handle = StageRun(run)
            if params:
                handle.log_params(params)
            log.info("MLflow run %s (stage %s) at %s", run_id, stage, tracking_uri())
            yield handle
    except MlflowException as err:
        access_refused(err, stage)
        lost_server(err, stage, run_id)
        raise


def lost_server(err: Exception, stage: str, run_id: str | None) -> None:
    """A UserError when `err` came from a tracking server that stopped answering mid-run."""
    from tasks.common.errors import UserError

    uri = tracking_uri()
    if run_id is None or not uri.startswith(("http://", "https://")) or server_answers(uri):
        return
    first = err.__context__
    before = f" The stage had failed first: {type(first).__name__}: {first}." if (
        first is not None and not isinstance(first, type(err))) else ""
    raise UserError(
        f"the MLflow tracking server {uri} stopped answering during the run of stage '{stage}' "
        f"(MLflow run {run_id}; last error: {err}).{before} The stage failed and its run may stay "
        "RUNNING on the server. Restart the server (infra/README.md), then rerun the stage; "
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES and MLFLOW_HTTP_REQUEST_TIMEOUT set how long a run rides "
        "out an outage"
    ) from None


def server_answers(uri: str) -> bool:
    """True when the MLflow server at `uri` answers its /health within 3 s."""
    try:
        with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=3) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False
