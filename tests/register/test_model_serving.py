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


def _post(url: str, body: object, timeout: float = 300) -> tuple[int, dict]:
    request = urllib.request.Request(f"{url}/invocations", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


#: The endpoint's bad-input table: each request, the message its HTTP 400 must carry.
BAD_REQUESTS = [
    ({"inputs": ["a"], "params": {"num_inference_steps": -3}},
     "num_inference_steps: -3 is out of range; allowed: an integer from 1 to 100"),
    ({"inputs": ["a"], "params": {"num_inference_steps": 100000}}, "num_inference_steps: 100000 is out of range"),
    ({"inputs": ["a"], "params": {"num_inference_steps": "many"}}, "num_inference_steps"),  # MLflow's type check
    ({"inputs": ["a"], "params": {"height": 65}}, "height: 65 is not a multiple of 2"),  # the tiny VAE: 2
    ({"inputs": ["a"], "params": {"width": 4096}}, "width: 4096 is out of range; allowed: an integer from 64 to 1024"),
    ({"inputs": ["a"], "params": {"guidance_scale": -2}}, "guidance_scale: -2.0 is out of range"),
    ({"inputs": ["a"], "params": {"num_images_per_prompt": 9}}, "num_images_per_prompt: 9 is out of range"),
    ({"inputs": ["a"] * 9}, "inputs: 9 prompts; allowed: 1 to 8 per request"),
    ({"inputs": [""]}, "inputs[0]: '' is not a prompt; allowed: a non-empty string"),
    ({"inputs": []}, "missing inputs"),  # MLflow's schema check
    ({"prompts": ["a"]}, "inputs"),  # no inputs key at all
]


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
        start = time.monotonic()
        status, answer = _post(url, body)
        assert status == 200, answer
        print(f"\nmodel v{result.version} served after {ready_s:.1f} s; "
              f"2 images in {time.monotonic() - start:.1f} s")
        rows = answer["predictions"]
        assert [(r["prompt"], r["seed"]) for r in rows] == [("a photo of sks toy", 3),
                                                             ("a red sks toy", 4)]
        for row in rows:
            image = Image.open(io.BytesIO(base64.b64decode(row["image"])))
            assert image.format == "PNG" and image.size == (64, 64)
        for bad, message in BAD_REQUESTS:
            status, answer = _post(url, bad, timeout=60)
            assert status == 400 and message in str(answer.get("message")), (bad, status, str(answer)[:500])
        status, answer = _post(url, {"inputs": ["a"], "params": {"num_inference_steps": 1, "seed": 9}})
        assert status == 200 and answer["predictions"][0]["seed"] == 9, "still serving after bad requests"
    finally:
        stop_process_group(proc)
