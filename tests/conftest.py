"""Shared fixtures: every test gets its own MLflow store, so no test writes the repo's mlflow.db."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def migrated_mlflow_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty MLflow SQLite store with its schema created once (migrations take seconds)."""
    from mlflow.tracking import MlflowClient

    path = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture(autouse=True)
def isolated_mlflow(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch, migrated_mlflow_db: Path
) -> str:
    store = tmp_path_factory.mktemp("mlflow")
    shutil.copy(migrated_mlflow_db, store / "mlflow.db")
    uri = f"sqlite:///{store / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.delenv("FINETUNE_PARENT_RUN_ID", raising=False)
    monkeypatch.setenv("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # Artifacts of a sqlite-backed store land under the working directory: keep them in tmp.
    monkeypatch.chdir(store)
    return uri


def stage_runs(uri: str, experiment: str = "finetune") -> list:
    """All MLflow runs of an experiment in the store at `uri` (newest first)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    return [] if exp is None else client.search_runs([exp.experiment_id])
