"""The pipeline's parent run (flows/parent_run.py) on a throw-away sqlite store."""
from __future__ import annotations

from pathlib import Path

import mlflow

from flows.parent_run import KILLED_STAGE, parent_run


def test_a_stage_run_its_killed_process_left_running_is_closed_with_the_parent(
        isolated_mlflow: str, tmp_path: Path) -> None:
    with parent_run(tmp_path, None) as parent:
        experiment = parent.client.get_run(parent.run_id).info.experiment_id
        tags = {"mlflow.parentRunId": parent.run_id}
        killed = parent.client.create_run(experiment, tags=tags)  # its process was SIGKILLed
        done = parent.client.create_run(experiment, tags=tags)
        parent.client.set_terminated(done.info.run_id, "FINISHED")
    client = mlflow.MlflowClient(isolated_mlflow)
    assert client.get_run(parent.run_id).info.status == "FINISHED"
    assert client.get_run(done.info.run_id).info.status == "FINISHED"
    assert client.get_run(killed.info.run_id).info.status == "KILLED"
    assert client.get_run(killed.info.run_id).data.tags["error"] == KILLED_STAGE
