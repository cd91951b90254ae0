"""After a worker dies: close the records its flow run left open, so the next run can start.

A worker killed with its flow run (the OOM killer, a node reboot, `kill -9`) cannot report the
end of that run. Prefect then keeps the flow run `Running` forever, and since the work pool runs
one flow at a time (flows/serve.py) no queued run would ever start; MLflow keeps the pipeline's
parent run and the interrupted stage's run `RUNNING`. `make serve` calls `crash_orphans` when it
starts and whenever it restarts a dead worker: with one worker per pool, any run of the pool still
Pending or Running at that moment belongs to no live process.

What is not lost: DVC recorded every stage that finished (dvc.lock), and `train` checkpoints
outside DVC's outputs, so the next run skips the finished stages and resumes training from the
last checkpoint.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger("flows.recovery")

MESSAGE = "its worker process died (killed or crashed) before the run ended; marked by flows.serve"


@dataclass(frozen=True)
class Orphan:
    flow_run_id: str
    name: str
    mlflow_runs: tuple[str, ...]  # parent and stage runs set to KILLED


def crash_orphans(api_url: str, pool: str, tracking_uri: str) -> list[Orphan]:
    """Mark the pool's unfinished flow runs Crashed and their open MLflow runs KILLED."""
    from prefect import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
        WorkPoolFilter,
        WorkPoolFilterName,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.states import Crashed

    unfinished = FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(
        any_=[StateType.PENDING, StateType.RUNNING, StateType.CANCELLING])))
    orphans = []
    with temporary_settings({PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=unfinished,
                                     work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[pool])))
        for run in runs:
            client.set_flow_run_state(run.id, Crashed(message=MESSAGE), force=True)
            killed = close_mlflow_runs(tracking_uri, str(run.id))
            log.warning("flow run %s (%s) was left %s by a dead worker: marked Crashed%s", run.name, run.id,
                        run.state_name, f"; MLflow runs {', '.join(killed)} marked KILLED" if killed else "")
            orphans.append(Orphan(str(run.id), run.name, tuple(killed)))
    return orphans


def close_mlflow_runs(tracking_uri: str, flow_run_id: str) -> list[str]:
    """The flow run's MLflow parent run and its stage runs still RUNNING, set to KILLED."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    if not experiments:
        return []
    parents = client.search_runs(experiments, filter_string=f"tags.`prefect.flow_run_id` = '{flow_run_id}'")
    killed = []
    for parent in parents:
        children = client.search_runs(experiments, filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
        for run in [parent, *children]:
            if run.info.status == "RUNNING":
                client.set_tag(run.info.run_id, "error", MESSAGE)
                client.set_terminated(run.info.run_id, "KILLED")
                killed.append(run.info.run_id)
    return killed
