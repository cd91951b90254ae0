"""`make serve`: a Prefect server, the deployments (finetune/main, finetune/nightly) and a worker,
in the foreground.

    python -m flows.serve          # 127.0.0.1:4200, or PREFECT_PORT
    python -m flows.serve --attach # a team's server (PREFECT_API_URL): deployments and worker only;
                                   # infra/compose.yaml's worker runs this

Runs the real programs: `prefect server start`, `prefect work-pool create`, `prefect deploy --all`
(every deployment in prefect.yaml) and `prefect worker start`. Prefect's state lives in `.prefect/` in the repository
(PREFECT_HOME), so it never mixes with another project's. Ctrl-C (or SIGTERM) stops the worker,
then the server. The server's own log goes to `.prefect/server.log`; flow runs log here.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from flows.recovery import crash_orphans
from tasks.common.errors import UserError, main_guard
from tasks.common.tracking import tracking_uri

log = logging.getLogger("flows.serve")

REPO = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
DEFAULT_PORT = 4200
DEPLOYMENT = "main"
POOL_CONCURRENCY = 1  # one checkout, one pipeline run at a time
SERVER_START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 30.0
#: A worker that dies (killed, out of memory) is restarted this many times before serve gives up.
MAX_WORKER_RESTARTS = 5


@dataclass
class Served:
    api_url: str
    pool: str
    server: subprocess.Popen | None  # None: attached to a server run elsewhere
    worker: subprocess.Popen
    seconds_to_ready: float
    _start_worker: Callable[[], subprocess.Popen] = field(repr=False)
    _recover: Callable[[], None] = field(repr=False)
    restarts: int = 0

    def restart_worker(self) -> None:
        """After the worker died: crash the flow run it left open, then start a new worker."""
        self.restarts += 1
        self._recover()
        self.worker = self._start_worker()


def port_from_env(env: Mapping[str, str] = os.environ) -> int:
    raw = env.get("PREFECT_PORT", str(DEFAULT_PORT))
    try:
        port = int(raw)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise UserError(
            f"PREFECT_PORT={raw!r} is not a port number (1-65535), e.g. PREFECT_PORT=4300"
        )
    return port


def check_port_free(host: str, port: int) -> None:
    """Fail with the fix when something already listens on host:port (e.g. another server)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # Same option the server sets: a port left in TIME_WAIT is free, a listening one is not.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as err:
            raise UserError(
                f"port {port} on {host} is already in use ({err.strerror}): another Prefect server "
                f"or program is listening there. Stop it, or choose another port: "
                f"PREFECT_PORT={port + 1} make serve "
                f"(then export PREFECT_API_URL=http://{host}:{port + 1}/api)"
            ) from None


def work_pool_name(root: Path = REPO, deployment: str = DEPLOYMENT) -> str:
    """The work pool named by the deployment in prefect.yaml (the one source of that name)."""
    spec = yaml.safe_load((root / "prefect.yaml").read_text()) or {}
    for dep in spec.get("deployments") or []:
        if dep.get("name") == deployment:
            return dep["work_pool"]["name"]
    raise UserError(f"prefect.yaml has no deployment named {deployment!r}")


def prefect_env(root: Path, api_url: str, base: Mapping[str, str] = os.environ) -> dict[str, str]:
    env = dict(base)
    env.setdefault("PREFECT_HOME", str(root / ".prefect"))
    env["PREFECT_API_URL"] = api_url
    env["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"  # telemetry would try the internet
    env.setdefault("DO_NOT_TRACK", "1")
    env["PREFECT_CLI_PROMPT"] = "false"
    env.setdefault("PREFECT_WORKER_QUERY_SECONDS", "2")  # pick up a new run within seconds
    # The flow runs stages as `python -m tasks.<stage>`: this venv's python first on PATH.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def _prefect(*args: str) -> list[str]:
    return [sys.executable, "-m", "prefect", *args]


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def wait_healthy(api_url: str, server: subprocess.Popen | None, log_path: Path,
                 timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server is not None and server.poll() is not None:
            raise UserError(
                f"prefect server exited with code {server.returncode} while starting; "
                f"its log ({log_path}) ends with:\n{_tail(log_path)}"
            )
        try:
            with urllib.request.urlopen(f"{api_url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    raise UserError(
        f"prefect server not healthy after {timeout:.0f} s; see {log_path}:\n{_tail(log_path)}"
    )


def _run(cmd: list[str], env: Mapping[str, str], cwd: Path, what: str) -> None:
    proc = subprocess.run(cmd, env=dict(env), cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        output = (proc.stdout + proc.stderr).strip()[-3000:]
        raise UserError(f"{what} failed (exit {proc.returncode}):\n{output}")
    log.info("%s: done", what)


def stop(proc: subprocess.Popen, name: str, timeout: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM, then SIGKILL if it is still there after `timeout` seconds."""
    if proc.poll() is not None:
        return
    log.info("stopping the %s (pid %s)", name, proc.pid)
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        log.warning("the %s did not stop in %.0f s; killing it", name, timeout)
        proc.kill()
        proc.wait()


@contextmanager
def serving(root: Path = REPO, port: int = DEFAULT_PORT, env: Mapping[str, str] = os.environ,
            worker_output: int | None = None) -> Iterator[Served]:
    """Server up, pool created, every deployment of prefect.yaml deployed, worker polling; all
    stopped on exit."""
    check_port_free(HOST, port)
    api_url = f"http://{HOST}:{port}/api"
    penv = prefect_env(root, api_url, env)
    home = Path(penv["PREFECT_HOME"])
    home.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    server_log = home / "server.log"
    with open(server_log, "ab") as sink:
        server = subprocess.Popen(
            _prefect("server", "start", "--host", HOST, "--port", str(port)),
            env=penv, cwd=root, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
        )
    served: Served | None = None
    try:
        log.info("starting the Prefect server on %s (log: %s)", api_url, server_log)
        wait_healthy(api_url, server, server_log, SERVER_START_TIMEOUT_S)
        log.info("server healthy after %.1f s", time.monotonic() - start)
        served = _deploy_and_work(root, api_url, penv, server, start, worker_output)
        yield served
    finally:
        if served is not None:
            stop(served.worker, "worker")
        stop(server, "server")


@contextmanager
def attached(root: Path = REPO, env: Mapping[str, str] = os.environ,
             worker_output: int | None = None) -> Iterator[Served]:
    """The same on a server run elsewhere (PREFECT_API_URL: a team's, infra/compose.yaml): pool,
    deployments and worker; the worker stopped on exit."""
    api_url = env.get("PREFECT_API_URL", "").rstrip("/")
    if not api_url.startswith(("http://", "https://")):
        raise UserError("--attach runs the worker for a Prefect server started elsewhere: set "
                        "PREFECT_API_URL to its API, e.g. PREFECT_API_URL=http://127.0.0.1:4200/api "
                        "(without --attach, this command starts a server of its own)")
    penv = prefect_env(root, api_url, env)
    start = time.monotonic()
    log.info("waiting for the Prefect server at %s", api_url)
    wait_healthy(api_url, None, Path("(the server's own log)"), SERVER_START_TIMEOUT_S)
    served = _deploy_and_work(root, api_url, penv, None, start, worker_output)
    try:
        yield served
    finally:
        stop(served.worker, "worker")


def _deploy_and_work(root: Path, api_url: str, penv: dict[str, str],
                     server: subprocess.Popen | None, start: float,
                     worker_output: int | None) -> Served:
    """The work pool (one run at a time), `prefect deploy --all`, runs a dead worker left open
    closed, and the worker started."""
    pool = work_pool_name(root)
    _run(_prefect("work-pool", "create", pool, "--type", "process", "--overwrite"), penv, root,
         f"work pool '{pool}'")
    # One flow run at a time from this pool: a nightly run and a manual one queue up instead
    # of the second being refused by the workspace lock (flows/workspace.py).
    _run(_prefect("work-pool", "set-concurrency-limit", pool, str(POOL_CONCURRENCY)), penv,
         root, f"work pool '{pool}' concurrency limit {POOL_CONCURRENCY}")
    _run(_prefect("deploy", "--all"), penv, root, "prefect deploy --all")

    def recover() -> None:
        try:
            crash_orphans(api_url, pool, penv.get("MLFLOW_TRACKING_URI") or tracking_uri(root))
        except Exception as err:  # never keep the server from serving; say what is left open
            log.warning("could not close the runs a dead worker left open: %s", err)

    def start_worker() -> subprocess.Popen:
        return subprocess.Popen(
            _prefect("worker", "start", "--pool", pool, "--type", "process"),
            env=penv, cwd=root, stdout=worker_output,
            stderr=subprocess.STDOUT if worker_output else None, start_new_session=True,
        )

    recover()  # runs left open by a worker of an earlier `make serve` that died with it
    return Served(api_url, pool, server, start_worker(), round(time.monotonic() - start, 1),
                  start_worker, recover)


def _raise_keyboard_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _watch(served: Served) -> None:
    """Until Ctrl-C: stop when the server dies; restart a dead worker (closing what it left open)."""
    while True:
        if served.server is not None and served.server.poll() is not None:
            home = Path(os.environ.get("PREFECT_HOME", REPO / ".prefect"))
            raise UserError(f"the Prefect server exited (code {served.server.returncode}); "
                            f"stopping. Its log: {home / 'server.log'}")
        code = served.worker.poll()
        if code is not None:
            if served.restarts >= MAX_WORKER_RESTARTS:
                raise UserError(f"the Prefect worker exited (code {code}) after {served.restarts} "
                                "restarts; stopping. Its output is above.")
            print(f"the Prefect worker exited (code {code}); restarting it "
                  f"({served.restarts + 1} of {MAX_WORKER_RESTARTS})", flush=True)
            served.restart_worker()
            print("worker restarted; a run it left open is marked Crashed: run the "
                  "deployment again to resume (finished stages are skipped, training "
                  "continues from its last checkpoint)", flush=True)
        time.sleep(1)


@main_guard
def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m flows.serve", description=__doc__.split("\n")[0])
    parser.add_argument("--attach", action="store_true",
                        help="use the Prefect server at PREFECT_API_URL instead of starting one")
    args = parser.parse_args()
    # Ctrl-C and SIGTERM both stop cleanly; set explicitly, since a shell that starts us in the
    # background (`make serve &`) leaves SIGINT ignored, and Python then never raises on it.
    signal.signal(signal.SIGINT, _raise_keyboard_interrupt)
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        if args.attach:
            with attached(REPO) as served:
                print(f"\nworker on pool '{served.pool}' of the Prefect server {served.api_url}, "
                      f"deployments finetune/{DEPLOYMENT} and finetune/nightly; ready in "
                      f"{served.seconds_to_ready} s. Ctrl-C (SIGTERM) stops the worker.\n",
                      flush=True)
                _watch(served)
        port = port_from_env()
        with serving(REPO, port) as served:
            print(
                f"\nPrefect server {served.api_url} (UI http://{HOST}:{port}), deployment "
                f"finetune/{DEPLOYMENT}, worker on pool '{served.pool}'; "
                f"ready in {served.seconds_to_ready} s.\n"
                f"In another shell, from {REPO}:\n"
                f"  export PREFECT_API_URL={served.api_url}\n"
                f"  .venv/bin/prefect deployment run finetune/{DEPLOYMENT}\n"
                f"  .venv/bin/prefect deployment run finetune/nightly   # only if changed\n"
                "Ctrl-C here stops the worker and the server.\n",
                flush=True,
            )
            _watch(served)
    except KeyboardInterrupt:
        print("stopped the worker" + ("" if args.attach else " and the server"), flush=True)


if __name__ == "__main__":
    main()
