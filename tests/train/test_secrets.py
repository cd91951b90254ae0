"""`train.launch.env` values whose name looks secret show as *** in the stage's log (the launcher
line) and in its MLflow params; other values stay visible. A real `python -m tasks.train` under
mpirun (one rank) on the tiny SD model."""
from __future__ import annotations

import shutil

import pytest
from mlflow.tracking import MlflowClient

from tests.train.test_distributed import SETTINGS, run_stage

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None,
                                reason="needs mpirun: apt-get install openmpi-bin (.ci/run installs it)")


def test_launch_env_secrets_are_redacted_in_the_log_and_the_params(
        tmp_path, tiny_sd, instance_dir, class_dir, isolated_mlflow) -> None:
    section = {**SETTINGS, "max_train_steps": 1, "checkpointing_steps": 100, "checkpoints_dir": str(tmp_path / "c"),
               "launcher": "mpirun", "launch": {"num_processes": 1, "threads_per_process": 1, "env": {
                   "MLFLOW_TRACKING_PASSWORD": "planted-secret-123", "WANDB_API_KEY": "planted-key-456",
                   "TOKENIZERS_PARALLELISM": "false"}}}
    done = run_stage(tmp_path, section, (tiny_sd, instance_dir, class_dir),
                     env={"AWS_SECRET_ACCESS_KEY": "planted-aws-789"})
    assert done.returncode == 0, done.stderr[-4000:]
    log = done.stdout + done.stderr
    assert "launching 1 processes on 1 machine(s): " in log
    assert "MLFLOW_TRACKING_PASSWORD='***' " in log and "WANDB_API_KEY='***' " in log  # shell-quoted
    assert "TOKENIZERS_PARALLELISM=false " in log  # not a secret: whole name parts only
    assert not [s for s in ("planted-secret-123", "planted-key-456", "planted-aws-789") if s in log]
    client = MlflowClient(tracking_uri=isolated_mlflow)
    (run,) = client.search_runs([client.get_experiment_by_name("finetune").experiment_id], "tags.stage = 'train'")
    params = run.data.params
    assert params["launch.env.MLFLOW_TRACKING_PASSWORD"] == params["launch.env.WANDB_API_KEY"] == "***"
    assert params["launch.env.TOKENIZERS_PARALLELISM"] == "false"
    assert not [k for k, v in params.items() if "planted" in v]
