"""The nightly deployment run as its schedule runs it (a flow run of `finetune/nightly` created
through the Prefect API), watched with a poll that survives a server briefly down, and the
change made before each run (a new train seed, committed: something to retrain)."""
from __future__ import annotations

import base64
import json
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from tests.infra.stack import pipeline_credentials

DEPLOYMENT = "finetune/nightly"
FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
GIT = ["git", "-c", "user.name=team", "-c", "user.email=team@localhost"]
DONE = "pipeline done: "


def _headers(api: str, post: bool) -> dict[str, str]:
    """The auth string compose's clients hold; for a POST, a CSRF token fetched first (what
    Prefect's own client does)."""
    auth = pipeline_credentials()["PREFECT_API_AUTH_STRING"]
    headers = {"Content-Type": "application/json",
               "Authorization": "Basic " + base64.b64encode(auth.encode()).decode()}
    if post:
        request = urllib.request.Request(f"{api}/csrf-token?client=chaos", headers=headers)
        with urllib.request.urlopen(request, timeout=30) as response:
            token = json.loads(response.read())["token"]
        headers.update({"Prefect-Csrf-Token": token, "Prefect-Csrf-Client": "chaos"})
    return headers


def _call(api: str, path: str, body: dict[str, Any] | None = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{api}{path}", data=data, method="GET" if data is None
                                     else "POST", headers=_headers(api, data is not None))
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def start(api: str) -> str:
    """A new flow run of the nightly deployment (what its cron does); returns its id."""
    deployment = _call(api, f"/deployments/name/{DEPLOYMENT}")
    return _call(api, f"/deployments/{deployment['id']}/create_flow_run", {})["id"]


def state(api: str, flow_run: str) -> dict[str, str] | None:
    """{"type", "name", "message"} of the flow run's state; None while the server does not answer."""
    try:
        found = _call(api, f"/flow_runs/{flow_run}")["state"] or {}
    except (OSError, urllib.error.URLError, ValueError):
        return None
    return {"type": found.get("type", ""), "name": found.get("name", ""),
            "message": (found.get("message") or "")[:300]}


def wait(api: str, flow_run: str, timeout: float) -> dict[str, str]:
    """The flow run's final state, or its last one seen (name suffixed ", stuck") at `timeout`."""
    deadline = time.monotonic() + timeout
    last = {"type": "UNKNOWN", "name": "Unknown", "message": ""}
    while time.monotonic() < deadline:
        now = state(api, flow_run)
        if now is not None:
            last = now
            if now["type"] in FINAL:
                return now
        time.sleep(1)
    return {**last, "name": f"{last['name']}, stuck"}


def is_final(api: str, flow_run: str) -> bool:
    now = state(api, flow_run)
    return now is not None and now["type"] in FINAL


def change(repo: Path, seed: int) -> None:
    """Set train.seed and commit: the nightly check then sees changed params and retrains."""
    path = repo / "params.yaml"
    params = yaml.safe_load(path.read_text())
    params["train"]["seed"] = seed
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    subprocess.run(["git", "add", "params.yaml"], cwd=repo, check=True)
    subprocess.run([*GIT, "commit", "-q", "-m", f"train.seed {seed}"], cwd=repo, check=True)


def summary(log: str) -> dict[str, Any] | None:
    """The last `pipeline done: {...}` the flow logged in `log` (the worker's output)."""
    for line in reversed(log.splitlines()):
        if DONE in line:
            try:
                return json.loads(line.split(DONE, 1)[1])
            except ValueError:
                return None
    return None


def workspace_fingerprint(repo: Path) -> str | None:
    """The lineage fingerprint a registration of `repo`'s dvc.lock would carry now."""
    from flows.changes import lineage_of_workspace
    from tasks.register.lineage import fingerprint

    now = lineage_of_workspace(repo)
    return None if now is None else fingerprint(now)
