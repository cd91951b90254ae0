"""Helpers for end-to-end tests: a throw-away copy of the repository, free ports, a venv PATH."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent


#: evaluate and export's parity check at the least work that still runs every path (the e2e tests
#: check the chain, not the scores): what they would spend on the demo's full protocol is minutes.
QUICK_CHECKS = {"evaluate": {"max_prompts": 2, "images_per_prompt": 1, "num_inference_steps": 4},
                "export": {"parity": {"num_inference_steps": 2}}}


def merge_params(path: Path, params: dict[str, dict[str, Any]]) -> None:
    """Set `params`' keys in the params.yaml at `path`, section by section; a mapping given for a key
    that holds one updates it ({"ingest": {"captioner": {"mode": "missing"}}} keeps the captioner's
    other keys), as a user edits the file."""
    import yaml

    whole = yaml.safe_load(path.read_text())
    for section, keys in params.items():
        for key, value in keys.items():
            if isinstance(value, dict) and isinstance(whole[section].get(key), dict):
                whole[section][key].update(value)
            else:
                whole[section][key] = value
    path.write_text(yaml.safe_dump(whole, sort_keys=False))


def copy_repo(dst: Path, params: dict[str, dict[str, Any]] | None = None) -> Path:
    """Copy what a fresh clone has (tracked and untracked-not-ignored files) into a new git repo
    at `dst`, plus the generated demo images, and commit it, so `dvc` and git lineage work there.
    `params`: keys to set in params.yaml's sections first ({"train": {"max_train_steps": 3}})."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, check=True,
    ).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = REPO / rel
        if src.is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)
    env = e2e_env(dst)
    for script, out in (("generate.py", "subject"), ("concepts.py", "concepts"), ("edits.py", "edits")):
        subprocess.run([sys.executable, f"data/demo/{script}", "--out", f"data/demo/{out}"],
                       cwd=dst, env=env, check=True, capture_output=True)
    if params:
        merge_params(dst / "params.yaml", params)
    git = ["git", "-c", "user.name=e2e", "-c", "user.email=e2e@localhost"]
    subprocess.run(["git", "init", "-q"], cwd=dst, check=True)
    subprocess.run(["git", "add", "-A"], cwd=dst, check=True)
    subprocess.run([*git, "commit", "-q", "-m", "copy"], cwd=dst, check=True)
    return dst


def e2e_env(root: Path, **extra: str) -> dict[str, str]:
    """Environment for programs run in a repo copy: the venv first on PATH, the copy's code first
    on sys.path, Prefect state inside the copy, no telemetry."""
    env = dict(os.environ)
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(root)
    env["PREFECT_HOME"] = str(root / ".prefect")
    env["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    env["DO_NOT_TRACK"] = "1"
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop_process_group(proc: subprocess.Popen[Any], timeout: float = 30) -> None:
    """SIGTERM a server started with start_new_session=True (and its children), then SIGKILL."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
