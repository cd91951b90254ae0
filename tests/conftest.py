"""Shared fixtures: every test gets its own MLflow store, so no test writes the repo's mlflow.db."""
from __future__ import annotations

import gc
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def disk_syncs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, ...]]:
    """What reaches the disk, in order: ("fsync", path) per os.fsync, ("replace", src, dst) per
    os.replace. The real calls still run (Linux: an fsync's path is read from /proc/self/fd)."""
    events: list[tuple[str, ...]] = []
    fsync, replace = os.fsync, os.replace

    def spy_fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def spy_replace(src, dst, **kw) -> None:
        replace(src, dst, **kw)
        events.append(("replace", os.path.realpath(src), os.path.realpath(dst)))

    monkeypatch.setattr(os, "fsync", spy_fsync)
    monkeypatch.setattr(os, "replace", spy_replace)
    return events


@pytest.fixture(scope="session")
def migrated_mlflow_db(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty MLflow SQLite store with its schema created once: its migrations take 5 s of a core (20 s
    on a busy 2-core machine), which every xdist worker paid before its first test. Kept in pytest's
    cache (.pytest_cache/d/mlflow-schema) per MLflow version, the schema's only source, so later
    workers and runs copy it; each test still gets its own copy (isolated_mlflow)."""
    import mlflow
    from mlflow.tracking import MlflowClient

    cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider
    cached = cache.mkdir("mlflow-schema") / f"mlflow-{mlflow.__version__}.db" if cache else None
    if cached is not None and cached.is_file():
        return cached
    path = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()
    if cached is not None:  # whole or not at all: workers may write it at once
        partial = cached.with_name(f"{cached.name}.{os.getpid()}.partial")
        shutil.copy(path, partial)
        os.replace(partial, cached)
    return path


@pytest.fixture(autouse=True)
def isolated_mlflow(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch, migrated_mlflow_db: Path
) -> Iterator[str]:
    store = tmp_path_factory.mktemp("mlflow")
    shutil.copy(migrated_mlflow_db, store / "mlflow.db")
    uri = f"sqlite:///{store / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.delenv("FINETUNE_PARENT_RUN_ID", raising=False)
    monkeypatch.setenv("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # Artifacts of a sqlite-backed store land under the working directory: keep them in tmp.
    monkeypatch.chdir(store)
    reset_mlflow_globals()
    yield uri
    reset_mlflow_globals()


def reset_mlflow_globals() -> None:
    """Forget MLflow's process-wide state (active runs, tracking URI, experiment id).

    `mlflow.set_tracking_uri`/`set_experiment` (called by tasks.common.tracking.configure and by the
    flow) set module globals and MLFLOW_EXPERIMENT_ID in os.environ that would otherwise outlive a
    test's own store, so a later test would silently use an earlier test's.
    """
    import os

    import mlflow
    import mlflow.tracking.fluent as fluent

    while mlflow.active_run():
        mlflow.end_run()
    mlflow.set_tracking_uri(None)  # back to MLFLOW_TRACKING_URI
    fluent._active_experiment_id = None
    os.environ.pop("MLFLOW_EXPERIMENT_ID", None)


def stage_runs(uri: str, experiment: str = "finetune") -> list:
    """All MLflow runs of an experiment in the store at `uri` (newest first)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    return [] if exp is None else client.search_runs([exp.experiment_id])


#: Each test file's wall seconds in a whole run (tests/durations.json, written from a run's
#: PYTEST_TIMELINE by `python -m tests.timeline FILE --write-durations tests/durations.json`).
#: `make test` runs files in three workers (pytest-xdist, --dist loadfile --no-loadscope-reorder:
#: files are handed out in the order below), and a long file handed out last runs alone while the
#: other workers idle: so the longest go first (measured in CI, 2026-11-28: three files of 2.5 to 4.5
#: minutes under tests/train/ were handed out last, alphabetically, and the run ended 200 s after
#: the first worker idled). A file not in the table (a new one) counts as NEW_FILE_S.
DURATIONS = Path(__file__).with_name("durations.json")
NEW_FILE_S = 60.0


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    """After a module's last test (its module-scoped fixtures torn down), collect, then freeze what is
    left alive (imported libraries, session fixtures: most of a test process's 800,000 objects) out of
    the garbage collector's reach. A full collection walked them all, about a second each time, and
    the stages' release_memory and Python's own full collections ran some 25 per worker in the quick
    tier. What a test makes is never frozen while it runs, so it is collected as before."""
    result = yield
    if nextitem is None or getattr(nextitem, "module", None) is not getattr(item, "module", None):
        gc.collect()
        gc.freeze()
    return result


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    seconds = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}

    def longest_first(item: pytest.Item) -> float:
        return -seconds.get(item.nodeid.split("::")[0], NEW_FILE_S)

    items.sort(key=longest_first)  # stable: a file's tests keep their order


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """With PYTEST_TIMELINE=<file>: one JSON line per test (worker, test, start, end: wall clock,
    set-up and teardown included), appended by every xdist worker, to see where a run's time goes
    (tests/timeline.py summarises it per file and worker)."""
    start = time.time()
    yield
    if path := os.environ.get("PYTEST_TIMELINE"):
        line = {"worker": os.environ.get("PYTEST_XDIST_WORKER", "main"), "test": item.nodeid,
                "start": round(start, 3), "end": round(time.time(), 3)}
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(line) + "\n")
