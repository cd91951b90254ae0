"""flows.recovery against a real Prefect server and a real MLflow store: a flow run left Running
by a dead worker is marked Crashed (freeing the pool's one slot), its open MLflow runs KILLED;
finished runs and other pools' runs are left alone."""
from __future__ import annotations

import mlflow
from prefect import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.states import Completed, Running

from flows.recovery import MESSAGE, crash_orphans


def _flow_run(client, pool: str, state):
    flow_id = client.create_flow_from_name("finetune")
    deployment = client.create_deployment(flow_id=flow_id, name=f"main-{pool}", work_pool_name=pool)
    run = client.create_flow_run_from_deployment(deployment)
    client.set_flow_run_state(run.id, state, force=True)
    return run


def test_a_dead_workers_runs_are_closed(prefect_server, isolated_mlflow) -> None:
    from prefect.settings import PREFECT_API_URL

    with get_client(sync_client=True) as client:
        for pool in ("sd-pool", "other-pool"):
            client.create_work_pool(WorkPoolCreate(name=pool, type="process"), overwrite=True)
        orphan = _flow_run(client, "sd-pool", Running())
        done = _flow_run(client, "sd-pool", Completed())
        elsewhere = _flow_run(client, "other-pool", Running())

    ml = mlflow.MlflowClient(isolated_mlflow)
    experiment = ml.create_experiment("recovery")
    parent = ml.create_run(experiment, tags={"prefect.flow_run_id": str(orphan.id)})
    stage = ml.create_run(experiment, tags={"mlflow.parentRunId": parent.info.run_id, "stage": "train"})
    finished = ml.create_run(experiment, tags={"mlflow.parentRunId": parent.info.run_id, "stage": "base"})
    ml.set_terminated(finished.info.run_id, "FINISHED")
    unrelated = ml.create_run(experiment, tags={"prefect.flow_run_id": str(elsewhere.id)})

    found = crash_orphans(PREFECT_API_URL.value(), "sd-pool", isolated_mlflow)

    assert [o.flow_run_id for o in found] == [str(orphan.id)]
    assert set(found[0].mlflow_runs) == {parent.info.run_id, stage.info.run_id}
    with get_client(sync_client=True) as client:
        crashed = client.read_flow_run(orphan.id).state
        assert crashed.type.value == "CRASHED" and crashed.message == MESSAGE
        assert client.read_flow_run(done.id).state.type.value == "COMPLETED"
        assert client.read_flow_run(elsewhere.id).state.type.value == "RUNNING"
    status = {r: ml.get_run(r).info.status for r in (parent.info.run_id, stage.info.run_id,
                                                      finished.info.run_id, unrelated.info.run_id)}
    assert list(status.values()) == ["KILLED", "KILLED", "FINISHED", "RUNNING"]
    assert ml.get_run(stage.info.run_id).data.tags["error"] == MESSAGE
    assert crash_orphans(PREFECT_API_URL.value(), "sd-pool", isolated_mlflow) == []  # idempotent
