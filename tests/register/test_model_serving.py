"""`mlflow models serve` (the real CLI, on a free loopback port) answers a scoring request for the
registered model with base64 PNGs. `--env-manager local`: serve from this venv (the default would
build a virtualenv, which needs the internet)."""
from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from PIL import Image

from tasks.register.core import register
from tests.e2e_util import free_port, stop_process_group


def _wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout: float = 400) -> float:
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


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_models_serve_answers_with_png_images(project: Path, tmp_path: Path) -> None:
    result = register(project / "models/finetuned", project / "models/openvino",
                      project / "reports/evaluate.json", project / "dvc.lock", project / "params.yaml")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    with open(log, "wb") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "models", "serve", "-m", "models:/sd-test@champion",
             "--env-manager", "local", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
            stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
            # It execs `uvicorn` by name: this venv's bin must be on PATH (an activated venv).
            env={**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"})
    try:
        ready_s = _wait_ready(url, proc, log)
        body = {"inputs": ["a photo of sks toy", "a red sks toy"],
                "params": {"num_inference_steps": 2, "seed": 3}}
        request = urllib.request.Request(f"{url}/invocations", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        start = time.monotonic()
        with urllib.request.urlopen(request, timeout=300) as resp:
            answer = json.loads(resp.read())
        print(f"\nmodel v{result.version} served after {ready_s:.1f} s; "
              f"2 images in {time.monotonic() - start:.1f} s")
        rows = answer["predictions"]
        assert [(r["prompt"], r["seed"]) for r in rows] == [("a photo of sks toy", 3),
                                                             ("a red sks toy", 4)]
        for row in rows:
            image = Image.open(io.BytesIO(base64.b64decode(row["image"])))
            assert image.format == "PNG" and image.size == (64, 64)
    finally:
        stop_process_group(proc)
