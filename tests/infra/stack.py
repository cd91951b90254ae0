"""The team stack's servers as tests start them: PostgreSQL from Debian's packages on loopback with
a temporary data directory, password authentication and infra/postgres/init.sh's roles, and the
MLflow and Prefect servers with infra/compose.yaml's command lines and environments (its
`${...}` filled with this session's SECRETS), doors locked as compose locks them (fixtures in
tests/infra/conftest.py)."""
from __future__ import annotations

import asyncio
import glob
import os
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO
from tests.e2e_util import e2e_env, free_port, stop_process_group

INFRA = REPO / "infra"
COMPOSE = yaml.safe_load((INFRA / "compose.yaml").read_text())
USER = "finetune"  # compose's default POSTGRES_USER


def _secret(name: str) -> str:
    # Random per session, unique to its variable (a leak names which), and made of the characters
    # that break a password pasted into a URL unquoted.
    return f"{name.lower()}/{secrets.token_hex(6)}@%:"


#: infra/env.example's secrets with this session's values (compose's `${NAME}`).
SECRETS = {name: _secret(name) for name in (
    "POSTGRES_PASSWORD", "MLFLOW_DB_PASSWORD", "PREFECT_DB_PASSWORD", "MLFLOW_ADMIN_PASSWORD",
    "MLFLOW_PIPELINE_PASSWORD", "MLFLOW_FLASK_SECRET_KEY", "PREFECT_AUTH_PASSWORD")}


def compose_env(service: str, postgres: Postgres | None = None, **overrides: str) -> dict[str, str]:
    """A service's `environment:` from infra/compose.yaml with `${NAME...}` filled from SECRETS
    (or the default after `:-`), `postgres:5432` pointed at the test's server; S3 settings
    (MinIO is not started here) left out."""
    def fill(match: re.Match) -> str:
        name, default = match.group(1), match.group(3) or ""
        return SECRETS.get(name, default)

    env = {}
    for key, value in (COMPOSE["services"][service].get("environment") or {}).items():
        if key.startswith(("AWS_", "MLFLOW_S3_")):
            continue
        value = re.sub(r"\$\{(\w+)(:-([^}]*)|:\?[^}]*)?\}", fill, str(value))
        if postgres is not None:
            value = value.replace("postgres:5432", f"127.0.0.1:{postgres.port}")
        env[key] = value
    env.update(overrides)
    return env


def pipeline_credentials() -> dict[str, str]:
    """What compose's worker authenticates with: MLflow's `pipeline` user, Prefect's auth string."""
    worker = compose_env("worker")
    return {k: worker[k] for k in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD",
                                   "PREFECT_API_AUTH_STRING")}
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

    def superuser_env(self) -> dict[str, str]:
        """libpq's variables for the superuser (psql, infra/postgres/init.sh)."""
        return {"PGHOST": "127.0.0.1", "PGPORT": str(self.port), "PGUSER": USER, "POSTGRES_USER": USER,
                "PGPASSWORD": SECRETS["POSTGRES_PASSWORD"]}

    def query(self, database: str, sql: str) -> list[tuple]:
        import asyncpg

        async def run() -> list[tuple]:
            conn = await asyncpg.connect(host="127.0.0.1", port=self.port, user=USER,
                                         password=SECRETS["POSTGRES_PASSWORD"],
                                         database=database)
            try:
                return [tuple(row) for row in await conn.fetch(sql)]
            finally:
                await conn.close()

        return asyncio.run(run())


def start_postgres(bindir: Path, root: Path) -> Postgres:
    """A cluster in `root` as compose's postgres makes one: scram-sha-256 passwords (the
    superuser's read from a file, not initdb's command line), then infra/postgres/init.sh's roles
    and databases with compose's variables. Started; the caller stops it (`ctl("stop")`)."""
    if os.geteuid() == 0:  # initdb and postgres refuse root: Debian's `postgres` user runs them
        shutil.chown(root, "postgres", "postgres")
    pg = Postgres(bindir, root, free_port())
    pwfile = root / "superuser-password"
    pwfile.write_text(SECRETS["POSTGRES_PASSWORD"] + "\n")
    if os.geteuid() == 0:
        shutil.chown(pwfile, "postgres", "postgres")
    subprocess.run(pg._as_owner(str(bindir / "initdb"), "-D", str(pg.data), "-U", USER,
                                "--auth=scram-sha-256", f"--pwfile={pwfile}", "-E", "UTF8",
                                "--no-locale", "--no-sync"),
                   check=True, capture_output=True, timeout=120)
    pwfile.unlink()
    pg.ctl("start")
    init_env = {**os.environ, **pg.superuser_env(),
                **{k: v for k, v in compose_env("postgres").items() if k.endswith("_DB_PASSWORD")}}
    init_env["PATH"] = f"{bindir}{os.pathsep}{init_env['PATH']}"
    subprocess.run(["sh", str(INFRA / "postgres/init.sh")], env=init_env, check=True,
                   capture_output=True, timeout=120)
    return pg


def start_prefect(postgres: Postgres, home: Path, port: int) -> subprocess.Popen:
    """compose's `prefect server start` with its environment (its auth string, CSRF, CORS, its own
    role) on `postgres`, Prefect's state and log in `home`; healthy."""
    env = e2e_env(home, **compose_env("prefect-server", PREFECT_SERVER_DATABASE_HOST="127.0.0.1",
                                      PREFECT_SERVER_DATABASE_PORT=str(postgres.port)))
    env["PREFECT_HOME"] = str(home)
    command = compose_command("prefect-server", host="127.0.0.1", port=str(port))
    return launch(command, env, home, f"http://127.0.0.1:{port}/api/health")


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


def launch(command: list[str], env: dict[str, str], home: Path, health: str) -> subprocess.Popen:
    """A server in a process group of its own, its output in home/server.log: healthy at
    `health`, or stopped."""
    with (home / "server.log").open("a") as log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        wait_healthy(health, proc)
    except BaseException:
        stop_process_group(proc)
        raise
    return proc


def needs_psycopg2() -> None:
    import importlib.util

    if importlib.util.find_spec("psycopg2") is None:
        pytest.skip("psycopg2 (psycopg2-binary in requirements.lock) is not installed here: "
                    "make install")


def auth_config(postgres: Postgres, home: Path) -> Path:
    """infra/mlflow/auth.ini, its database on the test's PostgreSQL."""
    path = home / "auth.ini"
    path.write_text((INFRA / "mlflow/auth.ini").read_text()
                    .replace("postgres:5432", f"127.0.0.1:{postgres.port}"))
    return path


def bootstrap_mlflow(uri: str) -> str:
    """compose's mlflow-init: infra/mlflow_access.py bootstrap, as the admin."""
    init = compose_env("mlflow-init", MLFLOW_TRACKING_URI=uri)
    proc = subprocess.run([sys.executable, str(INFRA / "mlflow_access.py"), "bootstrap"],
                          env=e2e_env(REPO, **init), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


def start_mlflow(postgres: Postgres, home: Path, port: int,
                 bootstrap: bool = True) -> subprocess.Popen:
    """compose's `mlflow server` (basic-auth app) on `postgres`, artifacts proxied into
    home/artifacts; healthy, and (`bootstrap`) mlflow-init's users and grants made: a server
    restarted on the same databases finds them there."""
    env = e2e_env(home, **compose_env("mlflow", postgres,
                                      MLFLOW_AUTH_CONFIG_PATH=str(auth_config(postgres, home))))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    command = compose_command("mlflow", host="127.0.0.1", port=str(port), workers="1",
                              **{"artifacts-destination": (home / "artifacts").as_uri(),
                                 "allowed-hosts": f"127.0.0.1:{port},localhost:{port}"})
    proc = launch(command, env, home, f"http://127.0.0.1:{port}/health")
    try:
        if bootstrap:
            bootstrap_mlflow(f"http://127.0.0.1:{port}")
    except BaseException:
        stop_process_group(proc)
        raise
    return proc


def add_user(uri: str, name: str, password: str, role: str = "reader") -> str:
    """infra/README.md's way to add a user: the admin runs mlflow_access.py, the password on
    stdin. What it printed."""
    admin = compose_env("mlflow-init", MLFLOW_TRACKING_URI=uri)
    done = subprocess.run([sys.executable, str(INFRA / "mlflow_access.py"), "add-user", name,
                           "--role", role], input=password + "\n", env=e2e_env(REPO, **admin),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and f"created as {role}" in done.stdout, done.stderr[-2000:]
    return done.stdout


def login(monkeypatch: pytest.MonkeyPatch, user: str, password: str) -> None:
    """MLflow's clients in this process act as `user` from now on, for this test only (MLflow
    reads the credentials from the environment when a request is made)."""
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", user)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", password)


def access_tool(monkeypatch: pytest.MonkeyPatch, uri: str, *argv: str, stdin: str = "") -> str:
    """infra/mlflow_access.py's main(argv) in this process (no interpreter start), as compose's
    mlflow-init runs it: the admin's credentials, `stdin` for a password. What it printed."""
    import contextlib
    import importlib.util
    import io

    for key, value in compose_env("mlflow-init", MLFLOW_TRACKING_URI=uri).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    spec = importlib.util.spec_from_file_location("mlflow_access", INFRA / "mlflow_access.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        tool.main(list(argv))
    return out.getvalue()


def pipeline_client(uri: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """An MlflowClient authenticated as the pipeline (MLflow reads the credentials from the
    environment when a request is made; set for this test only)."""
    import mlflow

    for key, value in pipeline_credentials().items():
        monkeypatch.setenv(key, value)
    return mlflow.MlflowClient(tracking_uri=uri)


class CommandLineWatch:
    """Samples every process's command line (/proc/*/cmdline) while it runs, keeping any that holds
    one of SECRETS' values: what `ps` would show anyone on the machine."""

    def __init__(self, interval: float = 0.2) -> None:
        import threading

        self.interval, self.samples, self.found = interval, 0, set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> CommandLineWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        values = [v.encode() for v in SECRETS.values()]
        while not self._stop.wait(self.interval):
            self.samples += 1
            for path in Path("/proc").glob("[0-9]*/cmdline"):
                try:
                    line = path.read_bytes()
                except OSError:
                    continue
                if any(v in line for v in values):
                    self.found.add(line.replace(b"\0", b" ").decode(errors="replace")[:200])


def leaked_secrets(postgres: Postgres, places: list[Path]) -> dict[str, list[str]]:
    """Which of SECRETS' values appear (name -> where) in a dump of every database on `postgres`
    (MLflow's runs, params, tags, registry; its users; Prefect's runs, logs, artifacts) or in any
    file under `places` (logs, the artifact store, the checkout)."""
    found: dict[str, list[str]] = {}
    dumps = postgres.root / "dumps"
    dumps.mkdir(exist_ok=True)
    for database in ("mlflow", "mlflow_auth", "prefect"):
        out = dumps / f"{database}.sql"
        subprocess.run([str(postgres.bindir / "pg_dump"), "-d", database, "-f", str(out)],
                       env={**os.environ, **postgres.superuser_env()}, check=True,
                       capture_output=True, timeout=300)
        places.append(out)
    for name, value in SECRETS.items():
        hits = subprocess.run(["grep", "-r", "-l", "-F", "-e", value, *map(str, places)],
                              capture_output=True, text=True).stdout.split()
        if hits:
            found[name] = hits
    return found
