"""Load on the served model: `mlflow models serve` on loopback, driven by 1, 4 and 16 clients.

    python benchmarks/serve/bench.py                       # the tiny model, 20 s per level
    python benchmarks/serve/bench.py --seconds 60 --workers 2 --levels 1 4 16 32
    python benchmarks/serve/bench.py --model-uri models:/sd-finetuned@candidate   # MLFLOW_TRACKING_URI set

Without --model-uri it builds the built-in tiny SD (64 px) and its OpenVINO export once into
.cache/bench/serve/ and saves them as a pyfunc with the registered model's own code and signature
(tasks/register/pyfunc_model.py), so the server runs exactly what a registered version runs.
Every request is one prompt, one image, `--steps` steps, seed = request number % 8; each answer's
image is compared with the single-client answer for that seed, so a wrong image counts as an
error like a non-200 answer. The server's RSS (all its processes) is sampled every 0.25 s.
Bounded: each level stops sending after --seconds (and at --max-requests) and waits for the
requests in flight. Prints a markdown table; writes JSON to --out.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
CACHE = REPO / ".cache" / "bench" / "serve"
PROMPT = "a photo of sks toy"
SEEDS = 8


def build_tiny(dst: Path) -> Path:
    """The tiny SD pipeline, its OpenVINO export (64 px) and the pyfunc around them (cached)."""
    model = dst / "pyfunc"
    if (model / "MLmodel").is_file():
        return model
    import mlflow
    from optimum.intel import OVStableDiffusionPipeline

    from tasks.common.families import build_tiny_pipeline
    from tasks.register.core import MODEL_CODE, pip_requirements
    from tasks.register.pyfunc_model import signature

    shutil.rmtree(dst, ignore_errors=True)
    finetuned = build_tiny_pipeline("builtin:tiny-sd", 0, dst / "finetuned")
    ov = OVStableDiffusionPipeline.from_pretrained(finetuned, export=True, compile=False)
    ov.reshape(batch_size=1, height=64, width=64, num_images_per_prompt=1)
    ov.save_pretrained(dst / "openvino")
    mlflow.pyfunc.save_model(model, python_model=str(MODEL_CODE), signature=signature(),
                             artifacts={"finetuned": str(finetuned), "openvino": str(dst / "openvino")},
                             pip_requirements=pip_requirements())
    return model


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree_rss_mb(proc: psutil.Process) -> float:
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


def rss_by_process(proc: psutil.Process) -> list[dict]:
    """Each server process: what it runs (the CLI, uvicorn's supervisor, a worker) and its RSS."""
    out = []
    for p in [proc, *proc.children(recursive=True)]:
        try:
            cmd = " ".join(p.cmdline())
            out.append({"pid": p.pid, "rss_mb": round(p.memory_info().rss / 2**20, 1),
                        "cmd": cmd if len(cmd) < 120 else cmd[:117] + "..."})
        except psutil.NoSuchProcess:
            pass
    return out


class Server:
    def __init__(self, model: str, workers: int, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
        self.log = open(log, "wb")  # noqa: SIM115 (the server writes to it until stop())
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "models", "serve", "-m", model, "--env-manager", "local",
             "--host", "127.0.0.1", "--port", str(self.port), "--workers", str(workers)],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        self.ps = psutil.Process(self.proc.pid)

    def wait_ready(self, timeout: float = 600) -> float:
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.proc.poll() is not None:
                raise SystemExit(f"mlflow models serve exited {self.proc.returncode}; see {self.log.name}")
            try:
                with urllib.request.urlopen(f"{self.url}/ping", timeout=5) as resp:
                    if resp.status == 200:
                        return time.monotonic() - start
            except (urllib.error.URLError, OSError):
                time.sleep(0.5)
        raise SystemExit(f"not ready after {timeout} s")

    def stop(self) -> None:
        import signal

        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()


def request(url: str, seed: int, steps: int) -> tuple[int, str, float]:
    """(HTTP status, sha256 of the image or the error text, seconds)."""
    body = {"inputs": [PROMPT], "params": {"seed": seed, "num_inference_steps": steps}}
    req = urllib.request.Request(f"{url}/invocations", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            image = json.loads(resp.read())["predictions"][0]["image"]
            return resp.status, hashlib.sha256(image.encode()).hexdigest(), time.perf_counter() - start
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()[:300], time.perf_counter() - start
    except (urllib.error.URLError, OSError) as err:
        return 0, str(err), time.perf_counter() - start


class RssSampler(threading.Thread):
    def __init__(self, proc: psutil.Process) -> None:
        super().__init__(daemon=True)
        self.proc, self.samples, self.running = proc, [], True

    def run(self) -> None:
        while self.running:
            self.samples.append(tree_rss_mb(self.proc))
            time.sleep(0.25)

    def stop(self) -> list[float]:
        self.running = False
        self.join()
        return self.samples


def level(server: Server, clients: int, seconds: float, max_requests: int, steps: int,
          reference: dict[int, str]) -> dict:
    counter = iter(range(max_requests))
    lock = threading.Lock()
    deadline = time.monotonic() + seconds
    results: list[tuple[int, bool, float]] = []

    def client() -> None:
        while time.monotonic() < deadline:
            with lock:
                n = next(counter, None)
            if n is None:
                return
            status, digest, took = request(server.url, n % SEEDS, steps)
            ok = status == 200 and digest == reference[n % SEEDS]
            with lock:
                results.append((status, ok, took))
            if not ok:
                print(f"  request {n}: HTTP {status} {'wrong image' if status == 200 else digest}", file=sys.stderr)

    sampler = RssSampler(server.ps)
    sampler.start()
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        for _ in range(clients):
            pool.submit(client)
    wall = time.perf_counter() - start
    rss = sampler.stop()
    latencies = sorted(took for _, _, took in results)
    q = statistics.quantiles(latencies, n=20, method="inclusive") if len(latencies) > 1 else latencies * 19
    return {
        "clients": clients, "requests": len(results), "errors": sum(not ok for _, ok, _ in results),
        "seconds": round(wall, 1), "requests_per_s": round(len(results) / wall, 2),
        "p50_s": round(statistics.median(latencies), 3), "p95_s": round(q[18], 3), "max_s": round(latencies[-1], 3),
        "rss_mb_start": round(rss[0], 1), "rss_mb_end": round(rss[-1], 1), "rss_mb_peak": round(max(rss), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-uri", help="serve this instead of the built-in tiny model")
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 4, 16], help="concurrent clients")
    parser.add_argument("--seconds", type=float, default=20.0, help="sending time per level")
    parser.add_argument("--max-requests", type=int, default=2000, help="per level")
    parser.add_argument("--steps", type=int, default=4, help="num_inference_steps per request")
    parser.add_argument("--workers", type=int, default=1, help="mlflow models serve --workers")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("results.json"))
    args = parser.parse_args()

    model = args.model_uri or str(build_tiny(CACHE))
    with tempfile.TemporaryDirectory() as tmp:
        server = Server(model, args.workers, Path(tmp) / "serve.log")
        try:
            ready_s = server.wait_ready()
            idle = tree_rss_mb(server.ps)
            reference = {}
            for seed in range(SEEDS):  # one client: the reference image of every seed (and the warm-up)
                status, digest, _ = request(server.url, seed, args.steps)
                if status != 200:
                    raise SystemExit(f"the reference request failed: HTTP {status} {digest}")
                reference[seed] = digest
            warm = tree_rss_mb(server.ps)
            processes = rss_by_process(server.ps)
            levels = [level(server, c, args.seconds, args.max_requests, args.steps, reference) for c in args.levels]
        finally:
            server.stop()
    result = {
        "model": args.model_uri or "builtin tiny SD, OpenVINO export, 64 px", "workers": args.workers,
        "steps": args.steps, "seconds_per_level": args.seconds, "ready_s": round(ready_s, 1),
        "rss_mb_idle": round(idle, 1), "rss_mb_after_warmup": round(warm, 1), "processes": processes,
        "levels": levels,
        "cpus": os.cpu_count(), "load_avg_at_end": [round(x, 2) for x in os.getloadavg()],
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print("| clients | requests | errors | req/s | p50 s | p95 s | max s | RSS MB start / end / peak |")
    print("|---|---|---|---|---|---|---|---|")
    for r in levels:
        print(f"| {r['clients']} | {r['requests']} | {r['errors']} | {r['requests_per_s']} | {r['p50_s']} | "
              f"{r['p95_s']} | {r['max_s']} | {r['rss_mb_start']} / {r['rss_mb_end']} / {r['rss_mb_peak']} |")
    print(f"ready after {result['ready_s']} s; RSS idle {idle:.0f} MB, after warm-up {warm:.0f} MB; "
          f"load average at the end {result['load_avg_at_end']}")


if __name__ == "__main__":
    main()
