"""The team stack's fixtures (one PostgreSQL per test module): tests/infra/stack.py starts them."""
from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e_util import free_port, stop_process_group
from tests.infra.stack import (
    NO_POSTGRES,
    Postgres,
    debian_postgres_bin,
    needs_psycopg2,
    start_mlflow,
    start_postgres,
    start_prefect,
)


@pytest.fixture(scope="module")
def postgres() -> Iterator[Postgres]:
    bindir = debian_postgres_bin()
    if bindir is None:
        pytest.skip(NO_POSTGRES)
    # Not under pytest's tmp_path: that is private to this user, and the server may run as
    # `postgres`.
    root = Path(tempfile.mkdtemp(prefix="finetune-pg-"))
    pg = Postgres(bindir, root, 0)
    try:
        pg = start_postgres(bindir, root)
        yield pg
    finally:
        if (pg.data / "postmaster.pid").exists():
            pg.ctl("stop")
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def prefect_on_postgres(
    postgres: Postgres, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    home = tmp_path_factory.mktemp("prefect-server")
    port = free_port()
    proc = start_prefect(postgres, home, port)
    try:
        yield f"http://127.0.0.1:{port}/api"
    finally:
        stop_process_group(proc)


@pytest.fixture(scope="module")
def mlflow_on_postgres(
    postgres: Postgres, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Path]]:
    needs_psycopg2()
    home = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    proc = start_mlflow(postgres, home, port)
    try:
        yield f"http://127.0.0.1:{port}", home / "artifacts"
    finally:
        stop_process_group(proc)
