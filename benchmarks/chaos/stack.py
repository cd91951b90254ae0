"""The team stack as tests/infra starts it (PostgreSQL from Debian's packages on loopback, the
Prefect and MLflow servers with infra/compose.yaml's command lines and environments, doors locked,
compose's worker command and credentials in a copy of the repository), with each piece killable
by SIGKILL and restartable as compose's `restart` policy (or an operator) would: same port, same
data, same command."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from tests.e2e_util import copy_repo, e2e_env, free_port, stop_process_group
from tests.infra.stack import (
    COMPOSE,
    Postgres,
    compose_env,
    debian_postgres_bin,
    start_mlflow,
    start_prefect,
)
from tests.infra.stack import start_postgres as start_test_postgres
from tests.infra.test_team_worker import team_setup

WORKER_READY = "started!"  # flows.serve deployed, then started the worker
HOOKS = Path(__file__).resolve().parent / "hooks"  # the registration's window opener


def start_postgres(root: Path) -> Postgres:
    """tests/infra's PostgreSQL: compose's roles and databases (infra/postgres/init.sh), passwords."""
    bindir = debian_postgres_bin()
    if bindir is None:
        raise SystemExit("PostgreSQL's server is not installed: apt-get install postgresql")
    root.mkdir(parents=True, exist_ok=True)
    return start_test_postgres(bindir, root)


def postmaster(pg: Postgres) -> psutil.Process | None:
    pid_file = pg.data / "postmaster.pid"
    try:
        return psutil.Process(int(pid_file.read_text().split()[0]))
    except (OSError, ValueError, IndexError, psutil.NoSuchProcess):
        return None


def kill_tree(root: psutil.Process) -> None:
    """SIGKILL a process and every descendant (a container's death), and wait for them."""
    procs = [root, *root.children(recursive=True)]
    for proc in procs:
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=30)


@dataclass
class Stack:
    """Every piece of the team stack, in `home` (a fresh temporary folder)."""
    home: Path
    pg: Postgres | None = None
    prefect: subprocess.Popen | None = None
    prefect_port: int = field(default_factory=free_port)
    mlflow: subprocess.Popen | None = None
    mlflow_port: int = field(default_factory=free_port)
    worker: subprocess.Popen | None = None
    repo: Path | None = None
    model: str = ""

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.prefect_port}/api"

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.mlflow_port}"

    @property
    def mlflow_home(self) -> Path:
        return self.home / "mlflow"

    def start(self) -> None:
        self.pg = start_postgres(Path(tempfile.mkdtemp(prefix="chaos-pg-")))
        self.start_prefect()
        self.mlflow_home.mkdir(exist_ok=True)
        self.start_mlflow()
        self.repo = copy_repo(self.home / "repo")
        remote = self.home / "dvc-remote"
        remote.mkdir()
        self.model = team_setup(self.repo, remote)
        self.start_worker()

    def start_prefect(self) -> None:
        home = self.home / "prefect-server"
        home.mkdir(exist_ok=True)
        self.prefect = start_prefect(self.pg, home, self.prefect_port)

    def start_mlflow(self, bootstrap: bool = True) -> None:
        self.mlflow = start_mlflow(self.pg, self.mlflow_home, self.mlflow_port, bootstrap)

    def worker_env(self) -> dict[str, str]:
        """compose's worker environment (less MinIO's credentials): MLflow's default retry budget
        (minutes) and FINETUNE_MLFLOW_WAIT_S, made for a restarting server, unlike the tests'."""
        env = e2e_env(self.repo, **compose_env("worker"))  # with its credentials
        env.update(PREFECT_API_URL=self.api, MLFLOW_TRACKING_URI=self.uri,
                   PREFECT_CLI_PROMPT="false", PREFECT_WORKER_QUERY_SECONDS="2")
        env.pop("PREFECT_UI_API_URL", None)
        self.window_dir.mkdir(exist_ok=True)
        env.update(PYTHONPATH=f"{HOOKS}{os.pathsep}{env['PYTHONPATH']}", CHAOS_WINDOW_DIR=str(self.window_dir))
        return env

    @property
    def window_dir(self) -> Path:
        """Where the registration's window opener (hooks/sitecustomize.py) is armed and says it waits."""
        return self.home / "window"

    @property
    def worker_log(self) -> Path:
        return self.home / "worker.log"

    def start_worker(self, timeout: float = 300) -> None:
        """compose's worker command in the copy; returns once it polls its pool."""
        start = self.worker_log.stat().st_size if self.worker_log.exists() else 0
        with self.worker_log.open("a") as sink:
            self.worker = subprocess.Popen(COMPOSE["services"]["worker"]["command"], shell=True,
                                           cwd=self.repo, env=self.worker_env(), stdout=sink,
                                           stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while WORKER_READY.encode() not in self.worker_log.read_bytes()[start:]:  # a byte offset
            if self.worker.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the worker did not start:\n"
                                   + self.worker_log.read_text(errors="replace")[-3000:])
            time.sleep(1)

    def stage_processes(self) -> list[psutil.Process]:
        """The running `python -m tasks.<stage>` processes under the worker."""
        found = []
        for proc in psutil.Process(self.worker.pid).children(recursive=True):
            try:
                words = proc.cmdline()
            except psutil.NoSuchProcess:
                continue
            if "-m" in words and any(w.startswith("tasks.") for w in words) \
                    and Path(words[0]).name.startswith("python"):
                found.append(proc)
        return found

    def stop(self) -> None:
        for proc in (self.worker, self.mlflow, self.prefect):
            if proc is not None and proc.poll() is None:
                stop_process_group(proc)
        if self.pg is not None:
            if postmaster(self.pg) is not None:
                self.pg.ctl("stop")
            shutil.rmtree(self.pg.root, ignore_errors=True)
