"""The pipeline run's MLflow record: one parent run per flow run, the stages' runs its children."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

from tasks.common.credentials import redact_params
from tasks.common.tracking import experiment_name, flatten, git_commit, server_answers, tracking_uri
from tasks.register.oneline import last_error, one_line


class ParentRun:
    """The pipeline run's MLflow record, written through an explicit client (thread-safe: Prefect
    may run tasks in other threads, where MLflow's fluent "active run" would not be set)."""

    def __init__(self, client: Any, run_id: str) -> None:
        self.client = client
        self.run_id = run_id

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, "" if v is None else str(v)[:6000]) for k, v in redact_params(flatten(params)).items()]
        for i in range(0, len(items), 100):  # MLflow caps a batch at 100 params
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def set_tags(self, tags: dict[str, Any]) -> None:
        for key, value in tags.items():
            self.client.set_tag(self.run_id, key, str(value))

    def log_artifact(self, path: Path) -> None:
        if path.is_file():
            self.client.log_artifact(self.run_id, str(path))

    def log_dict(self, data: dict[str, Any], name: str) -> None:
        self.client.log_dict(self.run_id, data, name)


#: The error tag of a stage run that its killed process left RUNNING (closed by its parent).
KILLED_STAGE = ("its stage process was killed (SIGKILL, out of memory) before it could end this run; "
                "the stage was retried or the pipeline run ended. Closed by the parent run")


def close_killed_stages(client: Any, experiment_id: str, run_id: str) -> list[str]:
    """The parent's stage runs still RUNNING as it ends, set to KILLED: the flow runs one stage at
    a time and waits for it, so such a run's process died without ending it."""
    children = client.search_runs([experiment_id],
                                  filter_string=f"tags.mlflow.parentRunId = '{run_id}'")
    closed = []
    for child in children:
        if child.info.status == "RUNNING":
            client.set_tag(child.info.run_id, "error", KILLED_STAGE)
            client.set_terminated(child.info.run_id, "KILLED")
            closed.append(child.info.run_id)
    return closed


def error_line(err: BaseException) -> str:
    """The failed run's `error` tag, one line: a failed stage's first sentence and its `error:` line
    (flows/dvc_stage.py StageFailed keeps the output's last lines), else the message without log prefixes."""
    tail = getattr(err, "tail", None)
    if isinstance(tail, list) and tail:
        first = str(err).splitlines()[0].removesuffix(" Last lines of its output:")
        return one_line(f"{first} {last_error(chr(10).join(tail))}", 5000)
    return one_line(str(err) or type(err).__name__, 5000)


@contextmanager
def parent_run(root: Path, flow_run_id: str | None) -> Iterator[ParentRun]:
    """Open the parent run (FINISHED on success, FAILED if the body raises)."""
    import mlflow

    uri = tracking_uri(root)
    mlflow.set_tracking_uri(uri)  # configure(), rooted at the repo rather than the cwd
    experiment = mlflow.set_experiment(experiment_name())
    client = mlflow.MlflowClient(uri)
    tags = {"pipeline": "finetune"}
    if flow_run_id:
        tags["prefect.flow_run_id"] = flow_run_id
    commit = git_commit(root)
    if commit:
        tags["mlflow.source.git.commit"] = commit
    name = f"finetune-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    run = client.create_run(experiment.experiment_id, run_name=name, tags=tags)
    try:
        yield ParentRun(client, run.info.run_id)
    except BaseException as err:
        if uri.startswith(("http://", "https://")) and not server_answers(uri):
            raise  # the lost server is the failure: the run stays RUNNING there
        close_killed_stages(client, experiment.experiment_id, run.info.run_id)
        client.set_tag(run.info.run_id, "error", error_line(err))
        client.set_terminated(run.info.run_id, "FAILED")
        raise
    close_killed_stages(client, experiment.experiment_id, run.info.run_id)
    client.set_terminated(run.info.run_id, "FINISHED")
