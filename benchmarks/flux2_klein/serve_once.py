"""A registered version behind `mlflow models serve` answers one request: the chain's last step.

    python -m benchmarks.flux2_klein.serve_once models:/sd-finetuned/1 [--steps 4] [--out image.png]

Starts the server as `make serve-model` does (the manifest-checked `tasks.register.verified`, one
worker, this environment's programs on PATH), waits for /ping, sends one prompt, checks the answer is
an image, stops the server and prints one JSON line: seconds to ready, seconds of the request, the
image's size. Exit 1 when the server dies, is not ready in time or answers anything but an image.
"""
from __future__ import annotations

import argparse
import base64
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from PIL import Image


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ready(url: str, proc: subprocess.Popen, timeout: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"mlflow models serve exited {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/ping", timeout=5) as resp:
                if resp.status == 200:
                    return time.monotonic() - start
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(2)
    raise SystemExit(f"mlflow models serve not ready after {timeout:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_uri")
    parser.add_argument("--prompt", default="a photo of sks dog")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("served.png"))
    parser.add_argument("--ready-timeout", type=float, default=1800)
    args = parser.parse_args()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.Popen([sys.executable, "-m", "tasks.register.verified", "models", "serve", "-m", args.model_uri,
                             "--env-manager", "local", "-h", "127.0.0.1", "-p", str(port), "--workers", "1",
                             "--timeout", "3600"], env=env, start_new_session=True)
    try:
        ready_s = _ready(url, proc, args.ready_timeout)
        body = {"inputs": [args.prompt], "params": {"num_inference_steps": args.steps, "seed": 0}}
        request = urllib.request.Request(f"{url}/invocations", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        start = time.monotonic()
        with urllib.request.urlopen(request, timeout=3600) as resp:
            answer = json.loads(resp.read())
        request_s = time.monotonic() - start
        image = Image.open(io.BytesIO(base64.b64decode(answer["predictions"][0]["image"])))
        image.save(args.out)
        print(json.dumps({"ready_s": round(ready_s, 1), "request_s": round(request_s, 1), "image": list(image.size)}))
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait()


if __name__ == "__main__":
    main()
