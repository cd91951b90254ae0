"""`make serve`'s checks that need no server: the port, the pool name, the environment.
(Starting the real server, deploying and running is tests/e2e/test_prefect_deployment.py.)"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from flows.serve import check_port_free, port_from_env, prefect_env, work_pool_name
from tasks.common.errors import UserError
from tests.conftest import REPO

pytestmark = pytest.mark.quick  # make test-fast


def test_taken_port_is_refused_with_the_fix() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = {**os.environ, "PREFECT_PORT": str(port), "PYTHONPATH": str(REPO)}
        proc = subprocess.run([sys.executable, "-m", "flows.serve"], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert f"port {port} on 127.0.0.1 is already in use" in proc.stderr
    assert f"PREFECT_PORT={port + 1} make serve" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_free_port_passes() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    check_port_free("127.0.0.1", port)


def test_port_from_env() -> None:
    assert port_from_env({}) == 4200
    assert port_from_env({"PREFECT_PORT": "4300"}) == 4300
    for bad in ("http", "0", "70000"):
        with pytest.raises(UserError, match="PREFECT_PORT"):
            port_from_env({"PREFECT_PORT": bad})


def test_pool_comes_from_prefect_yaml() -> None:
    assert work_pool_name(REPO) == "finetune"
    with pytest.raises(UserError, match="no deployment named 'nightly-x'"):
        work_pool_name(REPO, "nightly-x")


def test_prefect_state_is_project_local(tmp_path: Path) -> None:
    env = prefect_env(tmp_path, "http://127.0.0.1:4200/api", {"PATH": "/usr/bin"})
    assert env["PREFECT_HOME"] == str(tmp_path / ".prefect")
    assert env["PREFECT_API_URL"] == "http://127.0.0.1:4200/api"
    assert env["PREFECT_SERVER_ANALYTICS_ENABLED"] == "false"
    assert env["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)
    # A PREFECT_HOME the user chose (the Makefile exports the repo's .prefect) is kept.
    assert prefect_env(tmp_path, "x", {"PREFECT_HOME": "/elsewhere"})["PREFECT_HOME"] == "/elsewhere"


def test_deployments_main_and_nightly_match_the_flow() -> None:
    """prefect.yaml at schema level: entrypoints, parameters the flow accepts, a valid cron."""
    import yaml
    from prefect.client.schemas.schedules import CronSchedule
    from prefect.utilities.callables import parameter_schema

    from flows.finetune import finetune

    spec = yaml.safe_load((REPO / "prefect.yaml").read_text())
    deployments = {d["name"]: d for d in spec["deployments"]}
    assert set(deployments) == {"main", "nightly"}
    accepted = set(parameter_schema(finetune.fn).properties)
    for dep in deployments.values():
        assert dep["entrypoint"] == "flows/finetune.py:finetune"
        assert set(dep.get("parameters") or {}) <= accepted
        assert dep["work_pool"]["name"] == "finetune"
    nightly = deployments["nightly"]
    assert nightly["parameters"] == {"only_if_changed": True}
    (schedule,) = nightly["schedules"]
    CronSchedule(cron=schedule["cron"], timezone=schedule["timezone"])  # raises on a bad cron
    assert "schedules" not in deployments["main"]  # on demand only
