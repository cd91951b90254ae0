"""The team stack's fixtures (one PostgreSQL per test module): tests/infra/stack.py starts them."""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e_util import e2e_env, free_port, stop_process_group
from tests.infra.stack import (
    INFRA,
    NO_POSTGRES,
    SECRETS,
    USER,
    Postgres,
    compose_command,
    compose_env,
    debian_postgres_bin,
    needs_psycopg2,
    start_mlflow,
    wait_healthy,
)


@pytest.fixture(scope="module")
def postgres() -> Iterator[Postgres]:
    bindir = debian_postgres_bin()
    if bindir is None:
        pytest.skip(NO_POSTGRES)
    # Not under pytest's tmp_path: that is private to this user, and the server may run as
    # `postgres`.
    root = Path(tempfile.mkdtemp(prefix="finetune-pg-"))
    if os.geteuid() == 0:
        shutil.chown(root, "postgres", "postgres")
    pg = Postgres(bindir, root, free_port())
    pwfile = root / "superuser-password"  # initdb reads it from a file, not its command line
    pwfile.write_text(SECRETS["POSTGRES_PASSWORD"] + "\n")
    if os.geteuid() == 0:
        shutil.chown(pwfile, "postgres", "postgres")
    try:
        subprocess.run(pg._as_owner(str(bindir / "initdb"), "-D", str(pg.data), "-U", USER,
                                    "--auth=scram-sha-256", f"--pwfile={pwfile}", "-E", "UTF8",
                                    "--no-locale", "--no-sync"),
                       check=True, capture_output=True, timeout=120)
        pwfile.unlink()
        pg.ctl("start")
        # compose's postgres runs it once on an empty volume, with these variables.
        init_env = {**os.environ, **pg.superuser_env(),
                    **{k: v for k, v in compose_env("postgres").items() if k.endswith("_DB_PASSWORD")}}
        init_env["PATH"] = f"{bindir}{os.pathsep}{init_env['PATH']}"
        subprocess.run(["sh", str(INFRA / "postgres/init.sh")], env=init_env, check=True,
                       capture_output=True, timeout=120)
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
    env = e2e_env(home, **compose_env("prefect-server", PREFECT_SERVER_DATABASE_HOST="127.0.0.1",
                                      PREFECT_SERVER_DATABASE_PORT=str(postgres.port)))
    env["PREFECT_HOME"] = str(home)
    command = compose_command("prefect-server", host="127.0.0.1", port=str(port))
    log = (home / "server.log").open("w")
    proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/api/health", proc)
        yield f"http://127.0.0.1:{port}/api"
    finally:
        stop_process_group(proc)
        log.close()


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
