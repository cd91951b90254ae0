"""A registered version behind `mlflow models serve` answers one request: the chain's last step.

    python -m benchmarks.flux2_klein.serve_once models:/flux2-lora/1 [--steps 4] [--size 256] [--out image.png]

Starts `mlflow models serve` (one worker, this environment's programs on PATH: benchmarks/serve's
Server; the project installed, its models:/ loads are manifest-checked), waits for /ping, sends one
prompt, checks the answer is an image, stops the server and prints one JSON line: seconds to ready,
seconds of the request, the image's size. Exit 1 when the server dies, is not ready in time or
answers anything but an image.
"""
from __future__ import annotations

import argparse
import base64
import io
import json
import time
import urllib.request
from pathlib import Path

from PIL import Image

from benchmarks.serve.bench import Server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_uri")
    parser.add_argument("--prompt", default="a photo of sks dog")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--size", type=int, default=None, help="height and width asked (default: the model's)")
    parser.add_argument("--out", type=Path, default=Path("served.png"))
    parser.add_argument("--ready-timeout", type=float, default=1800)
    args = parser.parse_args()
    server = Server(args.model_uri, workers=1, log=args.out.with_suffix(".log"), timeout=3600)
    try:
        ready_s = server.wait_ready(args.ready_timeout)
        size = {"height": args.size, "width": args.size} if args.size else {}
        body = {"inputs": [args.prompt], "params": {"num_inference_steps": args.steps, "seed": 0, **size}}
        request = urllib.request.Request(f"{server.url}/invocations", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        start = time.monotonic()
        with urllib.request.urlopen(request, timeout=3600) as resp:
            answer = json.loads(resp.read())
        request_s = time.monotonic() - start
        image = Image.open(io.BytesIO(base64.b64decode(answer["predictions"][0]["image"])))
        image.save(args.out)
        print(json.dumps({"ready_s": round(ready_s, 1), "request_s": round(request_s, 1), "image": list(image.size)}))
    finally:
        server.stop()


if __name__ == "__main__":
    main()
