"""The team stack's servers as tests start them: PostgreSQL from Debian's packages on loopback with
a temporary data directory, and the MLflow and Prefect servers with infra/compose.yaml's command
lines (fixtures in tests/infra/conftest.py)."""
from __future__ import annotations

import asyncio
import glob
import os
import shlex
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO
from tests.e2e_util import e2e_env, stop_process_group

INFRA = REPO / "infra"
COMPOSE = yaml.safe_load((INFRA / "compose.yaml").read_text())
USER = "finetune"  # compose's default POSTGRES_USER
NO_POSTGRES = "PostgreSQL's server is not installed: apt-get install postgresql (.ci/run does)"


def debian_postgres_bin() -> Path | None:
    """The newest /usr/lib/postgresql/<major>/bin of Debian's postgresql package."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                   key=lambda p: int(p.split("/")[4]))
    return Path(found[-1]).parent if found else None


@dataclass
class Postgres:
    bindir: Path
    root: Path
    port: int

    @property
    def data(self) -> Path:
        return self.root / "data"

    def _as_owner(self, *command: str) -> list[str]:
        # initdb and postgres refuse to run as root: then they run as Debian's `postgres` user.
        return ["runuser", "-u", "postgres", "--", *command] if os.geteuid() == 0 else list(command)

    def ctl(self, action: str) -> None:
        options = f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.root} -c fsync=off"
        subprocess.run(self._as_owner(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-w",
                                      "-t", "60", "-o", options, "-l", str(self.root / "log"),
                                      action), check=True, capture_output=True, timeout=120)

    def url(self, driver: str, database: str) -> str:
        return f"postgresql+{driver}://{USER}@127.0.0.1:{self.port}/{database}"

    def query(self, database: str, sql: str) -> list[tuple]:
        import asyncpg

        async def run() -> list[tuple]:
            conn = await asyncpg.connect(host="127.0.0.1", port=self.port, user=USER,
                                         database=database)
            try:
                return [tuple(row) for row in await conn.fetch(sql)]
            finally:
                await conn.close()

        return asyncio.run(run())


def compose_command(service: str, **options: str) -> list[str]:
    """A service's command line from infra/compose.yaml, with `--<option> value` replaced."""
    words = shlex.split(COMPOSE["services"][service]["command"])
    for name, value in options.items():
        words[words.index(f"--{name}") + 1] = value
    return words


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 180) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if proc.poll() is not None:
            pytest.fail(f"{url}: the server exited with {proc.returncode}")
        try:
            urllib.request.urlopen(url, timeout=5).close()
            return time.monotonic() - start
        except OSError:
            time.sleep(1)
    pytest.fail(f"{url} not healthy after {timeout} s")


def needs_psycopg2() -> None:
    import importlib.util

    if importlib.util.find_spec("psycopg2") is None:
        pytest.skip("psycopg2 (psycopg2-binary in requirements.lock) is not installed here: "
                    "make install")


def start_mlflow(postgres: Postgres, home: Path, port: int) -> subprocess.Popen:
    """compose's `mlflow server` on `postgres`, artifacts proxied into home/artifacts; healthy."""
    env = e2e_env(home, MLFLOW_BACKEND_STORE_URI=postgres.url("psycopg2", "mlflow"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    command = compose_command("mlflow", host="127.0.0.1", port=str(port), workers="1",
                              **{"artifacts-destination": (home / "artifacts").as_uri(),
                                 "allowed-hosts": f"127.0.0.1:{port},localhost:{port}"})
    with (home / "server.log").open("a") as log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", proc)
    except BaseException:
        stop_process_group(proc)
        raise
    return proc
