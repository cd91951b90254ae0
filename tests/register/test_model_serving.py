"""`mlflow models serve` (the real CLI, on a free loopback port) answers a scoring request for the
registered model with base64 PNGs, refuses bad and over-budget requests, tells a request beyond the
wait queue to retry, and stops a generation at the server's timeout."""
from __future__ import annotations

import base64
import io
import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from PIL import Image

from finetune_runtime.convention import CallConvention
from tasks.register.core import register
from tests.register.http_serve import models_serve, post

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
    ({"inputs": ["a"] * 4, "params": {"num_images_per_prompt": 4, "num_inference_steps": 100, "height": 1024,
                                      "width": 1024}},  # within every field's range, far over the budget
     "request cost 4 prompts x num_images_per_prompt 4 x num_inference_steps 100 x height 1024 x width 1024 = "
     "1677721600 pixel-steps (2.05e+04 default images) is over this model's budget of 6553600 (80 images of "
     "64x64 px at 20 steps"),
    ({"inputs": ["x" * 2**20]}, "inputs[0]: 1048576 characters; allowed: at most 1000"),  # read whole, then refused
]
#: The served process's limits (MLflow's override of a logged model_config key, in the environment).
SERVE_CONFIG = {"budget_images": 80, "max_waiting": 1}
TIMEOUT_S = 10  # mlflow models serve --timeout


def _check_the_model_is_never_tied_up(url: str) -> None:
    """A within-budget request longer than the timeout (A, 16 images x 100 steps) holds the model; B
    waits for it, C is one too many (429); A gets MLflow's 504 and its generation stops there: B
    and then D are answered at once, not after A's remaining images."""
    long = {"inputs": ["a"] * 4, "params": {"num_images_per_prompt": 4, "num_inference_steps": 100}}
    short = {"inputs": ["b"], "params": {"num_inference_steps": 2}}
    answers: dict[str, tuple[int, dict | str, float]] = {}

    def send(name: str, body: dict, delay: float) -> None:
        time.sleep(delay)
        start = time.monotonic()
        request = urllib.request.Request(f"{url}/invocations", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as resp:
                answers[name] = resp.status, json.loads(resp.read()), time.monotonic() - start
        except urllib.error.HTTPError as err:
            answers[name] = err.code, err.read().decode(), time.monotonic() - start

    threads = [threading.Thread(target=send, args=a) for a in (("A", long, 0), ("B", short, 1), ("C", short, 2))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    (a, a_body, a_s), (b, _, b_s), (c, c_body, c_s) = answers["A"], answers["B"], answers["C"]
    assert a == 504 and TIMEOUT_S - 1 < a_s < TIMEOUT_S + 5, (a, a_s, a_body)
    assert c == 429 and c_s < 5, (c, c_s, c_body)
    error = json.loads(c_body)
    assert "busy: one request generating and 1 waiting" in error["message"] and error["retry_after_s"] >= 1
    assert b == 200 and b_s < a_s + 5, f"B waited {b_s:.1f} s: the model was held after A's 504"
    start = time.monotonic()
    assert post(url, short)[0] == 200 and time.monotonic() - start < 5


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_models_serve_answers_with_png_images(project: Path, tmp_path: Path) -> None:
    import mlflow

    result = register(project / "models/finetuned", project / "models/openvino",
                      project / "reports/evaluate.json", project / "dvc.lock", project / "params.yaml")
    config = mlflow.models.get_model_info(result.model_uri).flavors["python_function"]["config"]
    convention = CallConvention().as_config()  # SD 1.x: the shared call
    assert config == {"budget_images": 4.0, "max_waiting": 4, "adapter_cache_mb": 1024.0,
                      "pipeline_call": convention}, \
        "register's defaults and the family's call convention, logged with the model"
    with models_serve("models:/sd-test@champion", tmp_path / "serve.log", timeout_s=TIMEOUT_S,
                      config=SERVE_CONFIG) as (url, ready_s):
        body = {"inputs": ["a photo of sks toy", "a red sks toy"],
                "params": {"num_inference_steps": 2, "seed": 3}}
        start = time.monotonic()
        status, answer = post(url, body)
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
            status, answer = post(url, bad, timeout=60)
            assert status == 400 and message in str(answer.get("message")), (bad, status, str(answer)[:500])
        status, answer = post(url, {"inputs": ["a"], "params": {"num_inference_steps": 1, "seed": 9}})
        assert status == 200 and answer["predictions"][0]["seed"] == 9, "still serving after bad requests"
        _check_the_model_is_never_tied_up(url)
        log = (tmp_path / "serve.log").read_text()
        assert "stopped a request at image" in log, log[-2000:]


def _post_raw(url: str, body: bytes) -> tuple[int, bytes]:
    request = urllib.request.Request(f"{url}/invocations", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_the_readmes_serve_command_runs_as_written(project: Path, tmp_path: Path) -> None:
    """`make serve-model` (README.md, "What you get, and where to look") serves with this environment's
    bin off PATH, as a new user's shell has it: MLflow execs `uvicorn` by name, which
    `.venv/bin/mlflow models serve` alone cannot find. The install stamp is taken as it is (`-o`): the
    test is of serving, not installing. It prints uvicorn's lines only."""
    import os
    import subprocess
    import sys

    from tests.conftest import REPO
    from tests.e2e_util import free_port, stop_process_group
    from tests.register.http_serve import wait_ready

    register(project / "models/finetuned", project / "models/openvino", project / "reports/evaluate.json",
             project / "dvc.lock", project / "params.yaml")
    venv_bin = str(Path(sys.executable).parent)
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if p.rstrip("/") != venv_bin)
    env = {**os.environ, "PATH": path, "FINETUNE_SERVE_MAX_BODY_BYTES": "4096"}  # serve_app.py's limit, low
    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "wb") as sink:
        command = ["make", "-s", "-o", ".venv/.installed", "serve-model", "MODEL=models:/sd-test@champion",
                   f"PORT={port}"]
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, proc, log)
        status, answer = post(url, {"inputs": ["a photo of sks toy"], "params": {"num_inference_steps": 1}})
        assert status == 200, answer
        assert len(answer["predictions"]) == 1
        # a body over FINETUNE_SERVE_MAX_BODY_BYTES: 413 before MLflow reads it (tasks/register/serve_app.py)
        status, answer = _post_raw(url, json.dumps({"inputs": ["a" * 8000]}).encode())
        assert status == 413 and answer == b"Content Too Large", (status, answer[:300])
        # uvicorn's own lines only (where it listens, each request): no MLflow INFO, download bars or
        # library warnings as the model loads and predicts (finetune_runtime/quiet.py)
        printed = [line for line in log.read_text().splitlines() if line.strip()]
        assert printed and all(line.startswith("INFO:     ") for line in printed), "\n".join(printed)
    finally:
        stop_process_group(proc)
