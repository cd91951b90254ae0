"""A registered model behind the real `mlflow models serve` on a free loopback port, and its
requests. `--env-manager local`: serve from this venv (the default would build a virtualenv, which
needs the internet). The server reads the tracking URI from the environment, as a user's does."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.e2e_util import free_port, stop_process_group


def wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout: float = 400) -> float:
    """Seconds until `url/ping` answers 200; fails the test with the server's log otherwise."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if proc.poll() is not None:
            pytest.fail(f"mlflow models serve exited {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"{url}/ping", timeout=5) as resp:
                if resp.status == 200:
                    return time.monotonic() - start
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1)
    pytest.fail(f"mlflow models serve not ready after {timeout} s:\n{log.read_text()[-4000:]}")


def post(url: str, body: object, timeout: float = 300) -> tuple[int, dict]:
    """POST `body` to `url/invocations`: the HTTP status and the decoded JSON answer."""
    request = urllib.request.Request(f"{url}/invocations", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@contextmanager
def models_serve(model_uri: str, log: Path, *, timeout_s: int | None = None, config: dict | None = None,
                 env: dict[str, str] | None = None, cwd: Path | None = None) -> Iterator[tuple[str, float]]:
    """`mlflow models serve -m model_uri` (one worker): yields (its URL, seconds until ready) and
    stops its process group afterwards. `config`: MLflow's override of logged model_config keys;
    `env`: the server's environment (default: this process's)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "mlflow", "models", "serve", "-m", model_uri, "--env-manager", "local",
           "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    if timeout_s is not None:
        cmd += ["--timeout", str(timeout_s)]
    # It execs `uvicorn` by name: this venv's bin must be on PATH (an activated venv).
    env = dict(os.environ if env is None else env)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    if config is not None:
        env["MLFLOW_PYFUNC_INFERENCE_CONFIG"] = json.dumps(config)
    with open(log, "wb") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True, env=env,
                                cwd=cwd)
    try:
        yield url, wait_ready(url, proc, log)
    finally:
        stop_process_group(proc)
