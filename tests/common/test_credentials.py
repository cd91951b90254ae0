"""The credential table and the redaction rules (tasks/common/credentials.py)."""
from __future__ import annotations

import pytest

from flows.sections import stage_names
from tasks.common.credentials import STAGE_CREDENTIALS, looks_secret, redact, redact_params, stage_environ
from tasks.common.errors import UserError
from tests.conftest import REPO

ENV = {"PATH": "/bin", "MLFLOW_TRACKING_URI": "http://mlflow:5000", "MLFLOW_TRACKING_USERNAME": "pipeline",
       "MLFLOW_TRACKING_PASSWORD": "p", "PREFECT_API_AUTH_STRING": "finetune:a", "AWS_ACCESS_KEY_ID": "worker",
       "AWS_SECRET_ACCESS_KEY": "s", "HF_TOKEN": "h", "PGPASSWORD": "g", "TOKENIZERS_PARALLELISM": "false"}


@pytest.mark.parametrize("name", ["HF_TOKEN", "AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "PGPASSWORD",
                                  "PREFECT_API_AUTH_STRING", "GOOGLE_APPLICATION_CREDENTIALS", "wandb_api_key"])
def test_secret_looking_names(name) -> None:
    assert looks_secret(name)


@pytest.mark.parametrize("name", ["TOKENIZERS_PARALLELISM", "KEYBOARD_LAYOUT", "MLFLOW_TRACKING_URI", "PATH"])
def test_names_that_are_not_secret(name) -> None:
    assert not looks_secret(name)


def test_each_stage_keeps_its_row_only() -> None:
    assert set(STAGE_CREDENTIALS) == {*stage_names(REPO / "dvc.yaml"), "dvc"}  # a row for every stage
    kept = {stage: sorted(set(stage_environ(stage, ENV)) - {"PATH", "MLFLOW_TRACKING_URI", "TOKENIZERS_PARALLELISM"})
            for stage in ("ingest", "class_images", "train", "evaluate", "dvc")}
    assert kept["ingest"] == kept["class_images"] == []
    assert kept["train"] == kept["evaluate"] == ["MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_USERNAME"]
    assert "PREFECT_API_AUTH_STRING" not in kept["dvc"] and "AWS_SECRET_ACCESS_KEY" in kept["dvc"]
    with pytest.raises(UserError, match="no credential row for stage 'serve'"):
        stage_environ("serve", ENV)


def test_redaction_of_environments_and_params() -> None:
    assert redact({"HF_TOKEN": "h", "A": "1"}) == {"HF_TOKEN": "***", "A": "1"}
    flat = {"launch.env.WANDB_API_KEY": "k", "launch.env.A": "1", "placeholder_token": "<sks>"}
    assert redact_params(flat) == {"launch.env.WANDB_API_KEY": "***", "launch.env.A": "1",
                                   "placeholder_token": "<sks>"}
