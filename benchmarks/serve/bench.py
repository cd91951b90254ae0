"""Load on the served model: `mlflow models serve` on loopback, driven by 1, 4 and 16 clients.

    python benchmarks/serve/bench.py                       # the tiny model, 20 s per level
    python benchmarks/serve/bench.py --seconds 60 --workers 2 --levels 1 4 16 32
    python benchmarks/serve/bench.py --model-uri models:/sd-dreambooth@candidate   # MLFLOW_TRACKING_URI set

Without --model-uri it builds the built-in tiny SD (64 px) and its OpenVINO export once into
.cache/bench/serve/ and saves them as a pyfunc with the registered model's own code and signature
(finetune_runtime/, logged whole), so the server runs exactly what a registered version runs.
Every request is one prompt, one image, `--steps` steps, seed = request number % 8; each answer's
image is compared with the single-client answer for that seed, so a wrong image counts as an
error like a non-200 answer. The server's RSS (all its processes) is sampled every 0.25 s.
Bounded: each level stops sending after --seconds (and at --max-requests) and waits for the
requests in flight. A 429 (the model's wait queue full) is counted apart, not as an error; the
client waits its retry_after_s (at most 5 s) before its next request.

--long: one run of --clients clients (16) for --seconds, every 1/--over-budget-th request over
the model's cost budget (4 prompts x 4 images x 100 steps): it must be refused with HTTP 400.
Errors are the answers nobody asked for (a wrong image, a 5xx or 504, an over-budget request
accepted, a dropped connection); the server's RSS is reported every 5 s with its slope over the
second half (flat: no growth per request). Prints a markdown table; writes JSON to --out.
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


def build_tiny(dst: Path, model_config: dict | None = None) -> Path:
    """The tiny SD pipeline and its OpenVINO export (64 px), built once, and the pyfunc around them,
    saved afresh each time (the model's code and its serving limits may have changed)."""
    import mlflow

    from finetune_runtime.limits import serving_config, signature
    from tasks.register.core import MODEL_CODE, RUNTIME, pip_requirements

    finetuned, openvino, model = dst / "finetuned", dst / "openvino", dst / "pyfunc"
    if not (openvino / "model_index.json").is_file():
        from optimum.intel import OVStableDiffusionPipeline

        from tasks.common.families import build_tiny_pipeline

        shutil.rmtree(dst, ignore_errors=True)
        build_tiny_pipeline("builtin:tiny-sd", 0, finetuned)
        ov = OVStableDiffusionPipeline.from_pretrained(finetuned, export=True, compile=False)
        ov.reshape(batch_size=1, height=64, width=64, num_images_per_prompt=1)
        ov.save_pretrained(openvino)
    shutil.rmtree(model, ignore_errors=True)
    mlflow.pyfunc.save_model(model, python_model=str(MODEL_CODE), code_paths=[str(RUNTIME)], signature=signature(),
                             artifacts={"finetuned": str(finetuned), "openvino": str(openvino)},
                             pip_requirements=pip_requirements(), model_config=serving_config(model_config))
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
    def __init__(self, model: str, workers: int, log: Path, timeout: int = 60,
                 env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, **(env or {}),
               "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
        self.log = open(log, "wb")  # noqa: SIM115 (the server writes to it until stop())
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "models", "serve", "-m", model, "--env-manager", "local",
             "--host", "127.0.0.1", "--port", str(self.port), "--workers", str(workers),
             "--timeout", str(timeout)],
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


def request(url: str, seed: int, steps: int, over_budget: bool = False) -> tuple[int, str, float]:
    """(HTTP status, sha256 of the image or the error text, seconds). `over_budget`: 4 prompts x 4
    images x 100 steps, within every field's range and 20 times the default budget (4 images)."""
    body = {"inputs": [PROMPT], "params": {"seed": seed, "num_inference_steps": steps}}
    if over_budget:
        body = {"inputs": [PROMPT] * 4,
                "params": {"seed": seed, "num_inference_steps": 100, "num_images_per_prompt": 4}}
    req = urllib.request.Request(f"{url}/invocations", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            image = json.loads(resp.read())["predictions"][0]["image"]
            return resp.status, hashlib.sha256(image.encode()).hexdigest(), time.perf_counter() - start
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()[-300:], time.perf_counter() - start
    except (urllib.error.URLError, OSError) as err:
        return 0, str(err), time.perf_counter() - start


def outcome(status: int, answer: str, expected: str | None) -> str:
    """ok | busy (429: the wait queue was full; the client retries later) | refused (400: over the
    budget, as sent) | error (anything else: a wrong image, a 5xx, a 504, a dropped connection)."""
    if expected is None:  # sent over budget
        return "refused" if status == 400 and "over this model's budget" in answer else "error"
    if status == 429:
        return "busy"
    return "ok" if status == 200 and answer == expected else "error"


def retry_after(answer: str) -> float:
    """The `retry_after_s` of a 429's body, at most 5 s (1 s when it has none)."""
    try:
        return min(5.0, float(json.loads(answer).get("retry_after_s", 1)))
    except (ValueError, AttributeError):
        return 1.0


class RssSampler(threading.Thread):
    def __init__(self, proc: psutil.Process) -> None:
        super().__init__(daemon=True)
        self.proc, self.samples, self.times, self.running = proc, [], [], True

    def run(self) -> None:
        start = time.monotonic()
        while self.running:
            self.samples.append(tree_rss_mb(self.proc))
            self.times.append(time.monotonic() - start)
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
    results: list[tuple[str, float]] = []

    def client() -> None:
        while time.monotonic() < deadline:
            with lock:
                n = next(counter, None)
            if n is None:
                return
            status, digest, took = request(server.url, n % SEEDS, steps)
            kind = outcome(status, digest, reference[n % SEEDS])
            with lock:
                results.append((kind, took))
            if kind == "error":
                print(f"  request {n}: HTTP {status} {'wrong image' if status == 200 else digest}", file=sys.stderr)
            elif kind == "busy":
                time.sleep(retry_after(digest))

    wall, rss, sampler = _drive(server, clients, client)
    latencies = sorted(took for kind, took in results if kind == "ok") or [0.0]
    q = statistics.quantiles(latencies, n=20, method="inclusive") if len(latencies) > 1 else latencies * 19
    return {
        "clients": clients, "requests": len(results), "errors": sum(kind == "error" for kind, _ in results),
        "busy_429": sum(kind == "busy" for kind, _ in results),
        "seconds": round(wall, 1), "requests_per_s": round(len(results) / wall, 2),
        "p50_s": round(statistics.median(latencies), 3), "p95_s": round(q[18], 3), "max_s": round(latencies[-1], 3),
        "rss_mb_start": round(rss[0], 1), "rss_mb_end": round(rss[-1], 1), "rss_mb_peak": round(max(rss), 1),
    }


def rss_timeline(times: list[float], samples: list[float], every_s: float = 5.0) -> dict:
    """RSS over time: the peak of each `every_s` window (keyed by its start, s), and the slope
    (MB/min, least squares) over the second half of the run, where a leak would show once the
    queues are full."""
    windows: dict[int, float] = {}
    for t, mb in zip(times, samples, strict=True):
        key = int(t // every_s * every_s)
        windows[key] = max(windows.get(key, 0.0), mb)
    half = list(zip(times, samples, strict=True))[len(samples) // 2:]
    slope = 0.0
    if len(half) > 2:
        mean_t, mean_mb = statistics.fmean(t for t, _ in half), statistics.fmean(mb for _, mb in half)
        var = sum((t - mean_t) ** 2 for t, _ in half)
        slope = sum((t - mean_t) * (mb - mean_mb) for t, mb in half) / var * 60 if var else 0.0
    return {f"rss_mb_every_{every_s:g}s": [[t, round(mb, 1)] for t, mb in windows.items()],
            "rss_mb_per_min_second_half": round(slope, 2)}


def long_run(server: Server, clients: int, seconds: float, over_share: float, steps: int,
             reference: dict[int, str]) -> dict:
    """`clients` clients for `seconds`; request n is over budget when n x over_share crosses an
    integer (over_share 0.25: every 4th). Counts each outcome; errors are what nobody asked for."""
    lock, deadline, counter = threading.Lock(), time.monotonic() + seconds, iter(range(10**9))
    counts = {"ok": 0, "busy": 0, "refused": 0, "error": 0}
    latencies: list[float] = []
    errors: dict[str, int] = {}

    def client() -> None:
        while time.monotonic() < deadline:
            with lock:
                n = next(counter)
            over = int((n + 1) * over_share) > int(n * over_share)
            status, answer, took = request(server.url, n % SEEDS, steps, over_budget=over)
            kind = outcome(status, answer, None if over else reference[n % SEEDS])
            with lock:
                counts[kind] += 1
                if kind == "ok":
                    latencies.append(took)
                elif kind == "error":
                    key = f"HTTP {status} {'(over budget)' if over else ''}".strip()
                    errors[key] = errors.get(key, 0) + 1
            if kind == "busy":
                time.sleep(retry_after(answer))

    wall, rss, sampler = _drive(server, clients, client)
    timeline = rss_timeline(sampler.times, rss)
    latencies.sort()
    q = statistics.quantiles(latencies, n=20, method="inclusive") if len(latencies) > 1 else (latencies or [0]) * 19
    return {
        "clients": clients, "over_budget_share": over_share, "seconds": round(wall, 1),
        "requests": sum(counts.values()), "ok": counts["ok"], "refused_over_budget": counts["refused"],
        "busy_429": counts["busy"], "errors": counts["error"], "errors_by_kind": errors,
        "ok_per_s": round(counts["ok"] / wall, 2), "ok_p50_s": round(statistics.median(latencies or [0]), 3),
        "ok_p95_s": round(q[18], 3), "rss_mb_start": round(rss[0], 1), "rss_mb_end": round(rss[-1], 1),
        "rss_mb_peak": round(max(rss), 1), **timeline,
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-uri", help="serve this instead of the built-in tiny model")
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 4, 16], help="concurrent clients")
    parser.add_argument("--seconds", type=float, default=20.0, help="sending time per level (--long: in all)")
    parser.add_argument("--max-requests", type=int, default=2000, help="per level")
    parser.add_argument("--steps", type=int, default=4, help="num_inference_steps per request")
    parser.add_argument("--workers", type=int, default=1, help="mlflow models serve --workers")
    parser.add_argument("--timeout", type=int, default=60, help="mlflow models serve --timeout")
    parser.add_argument("--long", action="store_true",
                        help="one long run of --clients clients, a share of them over budget (not the levels)")
    parser.add_argument("--clients", type=int, default=16, help="--long: concurrent clients")
    parser.add_argument("--over-budget", type=float, default=0.25, help="--long: share of requests over budget")
    parser.add_argument("--serve-config", type=json.loads, default=None,
                        help='the model_config keys to override, e.g. \'{"max_waiting": 2}\' '
                             "(MLFLOW_PYFUNC_INFERENCE_CONFIG)")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON results (default: results.json, --long: results_long.json, here)")
    args = parser.parse_args()
    args.out = args.out or Path(__file__).with_name("results_long.json" if args.long else "results.json")
    return args


def measure(args: argparse.Namespace, model: str) -> dict:
    """Start the server, take the reference images, run the levels (or the long run), stop it."""
    env = {"MLFLOW_PYFUNC_INFERENCE_CONFIG": json.dumps(args.serve_config)} if args.serve_config else {}
    with tempfile.TemporaryDirectory() as tmp:
        server = Server(model, args.workers, Path(tmp) / "serve.log", args.timeout, env)
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
            out = {"ready_s": round(ready_s, 1), "rss_mb_idle": round(idle, 1), "rss_mb_after_warmup": round(warm, 1),
                   "processes": rss_by_process(server.ps)}
            if args.long:
                out["long"] = long_run(server, args.clients, args.seconds, args.over_budget, args.steps, reference)
            else:
                out["levels"] = [level(server, c, args.seconds, args.max_requests, args.steps, reference)
                                 for c in args.levels]
            out["server_log_stopped_requests"] = Path(tmp, "serve.log").read_text().count("stopped a request")
            return out
        finally:
            server.stop()


def report(result: dict) -> None:
    if "long" in result:
        r = result["long"]
        print("| clients | over budget | s | requests | ok | refused (400) | busy (429) | errors | ok/s | "
              "ok p50 / p95 s | RSS MB start / end / peak | RSS MB/min, 2nd half |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        print(f"| {r['clients']} | {r['over_budget_share']:.0%} | {r['seconds']} | {r['requests']} | {r['ok']} | "
              f"{r['refused_over_budget']} | {r['busy_429']} | {r['errors']} | {r['ok_per_s']} | {r['ok_p50_s']} / "
              f"{r['ok_p95_s']} | {r['rss_mb_start']} / {r['rss_mb_end']} / {r['rss_mb_peak']} | "
              f"{r['rss_mb_per_min_second_half']} |")
        print(f"errors by kind: {r['errors_by_kind']}; RSS every 5 s: {r['rss_mb_every_5s']}")
    else:
        print("| clients | requests | errors | busy (429) | req/s | p50 s | p95 s | max s | "
              "RSS MB start / end / peak |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in result["levels"]:
            print(f"| {r['clients']} | {r['requests']} | {r['errors']} | {r['busy_429']} | {r['requests_per_s']} | "
                  f"{r['p50_s']} | {r['p95_s']} | {r['max_s']} | {r['rss_mb_start']} / {r['rss_mb_end']} / "
                  f"{r['rss_mb_peak']} |")
    print(f"ready after {result['ready_s']} s; RSS idle {result['rss_mb_idle']:.0f} MB, after warm-up "
          f"{result['rss_mb_after_warmup']:.0f} MB; load average at the end {result['load_avg_at_end']}")



def _drive(server, clients: int, client) -> tuple[float, list, RssSampler]:
    """Run `client` on `clients` threads against `server` while sampling its RSS: (wall s, RSS samples, sampler)."""
    sampler = RssSampler(server.ps)
    sampler.start()
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        for _ in range(clients):
            pool.submit(client)
    wall = time.perf_counter() - start
    return wall, sampler.stop(), sampler


def main() -> None:
    args = parse_args()
    model = args.model_uri or str(build_tiny(CACHE))
    result = {
        "model": args.model_uri or "builtin tiny SD, OpenVINO export, 64 px", "workers": args.workers,
        "steps": args.steps, "seconds": args.seconds, "timeout_s": args.timeout, "serve_config": args.serve_config,
        **measure(args, model),
        "cpus": os.cpu_count(), "load_avg_at_end": [round(x, 2) for x in os.getloadavg()],
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    report(result)


if __name__ == "__main__":
    main()
