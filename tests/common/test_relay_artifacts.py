"""The relay copies only its own run (tasks/common/confine.py copy_runs, tasks/common/relay_artifacts.py):
a child's store whose run points elsewhere, links inside its artifacts, an oversize folder. Two real
local MLflow stores (SQLite), the relay's own copy function; no server needed for what is tested here."""
from __future__ import annotations

import os
import shutil
import sqlite3
from pathlib import Path

import pytest
from mlflow import MlflowClient

from tasks.common import relay_artifacts
from tasks.common.confine import RELAY_REFUSED_TAG, copy_runs
from tasks.common.tracking import experiment_name

pytestmark = pytest.mark.quick


@pytest.fixture(scope="module")
def empty_db(tmp_path_factory) -> Path:
    """An empty MLflow SQLite store, created once (its schema takes seconds), copied for each test."""
    db = tmp_path_factory.mktemp("template") / "mlflow.db"
    MlflowClient(f"sqlite:///{db}").search_experiments()
    return db


@pytest.fixture(scope="module")
def server(tmp_path_factory, empty_db) -> MlflowClient:
    db = tmp_path_factory.mktemp("server") / "mlflow.db"
    shutil.copy(empty_db, db)
    return MlflowClient(f"sqlite:///{db}")


@pytest.fixture
def stores(tmp_path: Path, empty_db: Path, server: MlflowClient) -> tuple[MlflowClient, MlflowClient, Path]:
    """(the child's store as run_relayed makes it, the server's stand-in, the child's store folder)."""
    store = tmp_path / "child"
    store.mkdir()
    shutil.copy(empty_db, store / "mlflow.db")
    child = MlflowClient(f"sqlite:///{store / 'mlflow.db'}")
    child.create_experiment(experiment_name(), (store / "artifacts").as_uri())
    return child, server, store


def _run(child: MlflowClient, files: dict[str, bytes], tmp_path: Path) -> str:
    """A finished run of the child's experiment with `files` logged as its artifacts (MLflow's own way)."""
    run = child.create_run(child.get_experiment_by_name(experiment_name()).experiment_id)
    child.log_param(run.info.run_id, "n", "1")
    local = tmp_path / f"logged-{run.info.run_id}"
    local.mkdir()
    for name, data in files.items():
        (local / name).parent.mkdir(parents=True, exist_ok=True)
        (local / name).write_bytes(data)
    child.log_artifacts(run.info.run_id, str(local))
    child.set_terminated(run.info.run_id)
    return run.info.run_id


def _copied(server: MlflowClient, new_id: str) -> list[str]:
    return sorted(f.path for f in server.list_artifacts(new_id))


def test_own_artifacts_copied(stores, tmp_path) -> None:
    child, server, store = stores
    _run(child, {"ingest.json": b"{}", "sub/rejected.json": b"[]"}, tmp_path)
    [new_id] = copy_runs(child, server, store)
    assert _copied(server, new_id) == ["ingest.json", "sub"]
    assert server.get_run(new_id).data.params == {"n": "1"}
    assert RELAY_REFUSED_TAG not in server.get_run(new_id).data.tags


def test_artifact_uri_pointing_elsewhere_copies_nothing_from_there(stores, tmp_path, capsys) -> None:
    child, server, store = stores
    infra = tmp_path / "checkout" / "infra"
    infra.mkdir(parents=True)
    (infra / ".env").write_text("MLFLOW_ADMIN_PASSWORD=planted\n")
    run_id = _run(child, {}, tmp_path)
    # the child rewrites its own run's record: its artifact_uri now names infra/
    with sqlite3.connect(store / "mlflow.db") as db:
        db.execute("UPDATE runs SET artifact_uri = ? WHERE run_uuid = ?", (infra.as_uri(), run_id))
    assert child.get_run(run_id).info.artifact_uri == infra.as_uri()
    [new_id] = copy_runs(child, server, store)
    assert _copied(server, new_id) == []  # nothing from infra/ (and the run's own folder is empty)
    said = capsys.readouterr().err
    assert f"artifact_uri names {infra.as_uri()}, not its own folder" in said and "planted" not in said
    assert "ignored" in server.get_run(new_id).data.tags[RELAY_REFUSED_TAG]


def test_link_inside_artifacts_not_followed(stores, tmp_path, capsys) -> None:
    child, server, store = stores
    secret = tmp_path / ".env"
    secret.write_text("PLANTED=1\n")
    run_id = _run(child, {"ingest.json": b"{}"}, tmp_path)
    (relay_artifacts.own_folder(store, run_id) / "env").symlink_to(secret)
    [new_id] = copy_runs(child, server, store)
    assert _copied(server, new_id) == []  # the run's artifacts refused as a whole
    reason = capsys.readouterr().err.strip().splitlines()[-1]
    assert reason.startswith("relay: ") and "artifacts/env is a link" in reason and "PLANTED" not in reason
    assert "is a link" in server.get_run(new_id).data.tags[RELAY_REFUSED_TAG]


def test_linked_artifacts_folder_not_followed(stores, tmp_path) -> None:
    child, server, store = stores
    elsewhere = tmp_path / "infra"
    elsewhere.mkdir()
    (elsewhere / ".env").write_text("PLANTED=1\n")
    run_id = _run(child, {}, tmp_path)
    own = relay_artifacts.own_folder(store, run_id)
    own.rmdir()
    own.symlink_to(elsewhere, target_is_directory=True)
    [new_id] = copy_runs(child, server, store)
    assert _copied(server, new_id) == []
    assert f"{own} is a link, not a folder" in server.get_run(new_id).data.tags[RELAY_REFUSED_TAG]


def test_fifo_inside_artifacts_refused_unopened(stores, tmp_path) -> None:
    child, server, store = stores
    run_id = _run(child, {"ingest.json": b"{}"}, tmp_path)
    os.mkfifo(relay_artifacts.own_folder(store, run_id) / "stall.png")
    [new_id] = copy_runs(child, server, store)  # returns: a FIFO is never opened
    assert _copied(server, new_id) == []
    assert "stall.png is a FIFO" in server.get_run(new_id).data.tags[RELAY_REFUSED_TAG]


def test_oversize_artifacts_refused(stores, tmp_path, monkeypatch, capsys) -> None:
    child, server, store = stores
    monkeypatch.setenv(relay_artifacts.MAX_BYTES_ENV, "1000")
    _run(child, {"a.bin": b"x" * 600, "b.bin": b"x" * 600}, tmp_path)
    [new_id] = copy_runs(child, server, store)
    assert _copied(server, new_id) == []
    reason = capsys.readouterr().err.strip().splitlines()[-1]
    assert "holds more than 1000 bytes (FINETUNE_RELAY_MAX_BYTES)" in reason and "b.bin" in reason
    monkeypatch.setenv(relay_artifacts.MAX_BYTES_ENV, "1200")  # exactly at the cap: copied
    [again] = copy_runs(child, server, store)
    assert _copied(server, again) == ["a.bin", "b.bin"]


def test_bad_cap_named(monkeypatch) -> None:
    monkeypatch.setenv(relay_artifacts.MAX_BYTES_ENV, "lots")
    with pytest.raises(ValueError, match="FINETUNE_RELAY_MAX_BYTES='lots' is not a number of bytes"):
        relay_artifacts.max_bytes()
    monkeypatch.delenv(relay_artifacts.MAX_BYTES_ENV)
    assert relay_artifacts.max_bytes() == relay_artifacts.DEFAULT_MAX_BYTES
