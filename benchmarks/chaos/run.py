"""The chaos run: the nightly flow on the PostgreSQL team stack, each run after a change (a new
train seed) and with one SIGKILL (a stage, the worker, the MLflow server, PostgreSQL or the Prefect
server at a random moment; the worker at a drawn point of the registration), the piece restarted,
then a rerun with everything up; then the registry's audit.

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.chaos.run --runs 20 --seed 0

Results: benchmarks/chaos/results.json (or --out) and a table on stdout (README.md).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.chaos import audit, kills, nightly
from benchmarks.chaos.hooks.sitecustomize import POINTS
from benchmarks.chaos.stack import Stack
from tests.infra.stack import pipeline_credentials

HERE = Path(__file__).resolve().parent
#: A rerun that fails is run again (an operator would), at most this many times in all.
MAX_RERUNS = 3


def _log_offset(stack: Stack) -> int:
    return stack.worker_log.stat().st_size if stack.worker_log.exists() else 0


def quiet_run(stack: Stack, label: str) -> dict[str, Any]:
    """A nightly run with nothing killed (the warm-up and the calibration run)."""
    offset, start = _log_offset(stack), time.monotonic()
    flow_run = nightly.start(stack.api)
    final = nightly.wait(stack.api, flow_run, timeout=3600)
    record = {"run": label, "target": "none", "killed": None, "first_state": final["name"],
              "run_s": round(time.monotonic() - start, 1)}
    record.update(_after_rerun(stack, final, offset))
    return record


def _kill_during(stack: Stack, flow_run: str, target: str, delay: float) -> kills.Kill | None:
    """Wait `delay` seconds into the run (a stage kill: then the next stage process), then kill
    `target`; None when the run ended first."""
    deadline = time.monotonic() + delay
    while time.monotonic() < deadline:
        if nightly.is_final(stack.api, flow_run):
            return None
        time.sleep(0.5)
    while not nightly.is_final(stack.api, flow_run):
        done = kills.kill(stack, target)
        if done is not None:
            return done
        time.sleep(0.2)
    return None


def _summary(stack: Stack, offset: int, wait_s: float) -> dict[str, Any]:
    """The flow's `pipeline done` summary logged after `offset`; the worker relays the flow
    run's output a moment after the run's state is final, so it is waited for."""
    deadline = time.monotonic() + wait_s
    while True:
        with stack.worker_log.open("rb") as log:
            log.seek(offset)
            done = nightly.summary(log.read().decode(errors="replace"))
        if done is not None or time.monotonic() > deadline:
            return done or {}
        time.sleep(0.5)


def _after_rerun(stack: Stack, final: dict[str, str], offset: int) -> dict[str, Any]:
    """What a finished (re)run left: its summary, the workspace fingerprint, `candidate`."""
    import mlflow

    done = _summary(stack, offset, wait_s=20 if final["type"] == "COMPLETED" else 0)
    record: dict[str, Any] = {"rerun_state": final["name"], "rerun_message": final["message"],
                              "up_to_date": bool(done.get("up_to_date")),
                              "registered": (done.get("registered") or {}).get("version"),
                              "fingerprint": nightly.workspace_fingerprint(stack.repo)}
    try:
        candidate = mlflow.MlflowClient(stack.uri).get_model_version_by_alias(stack.model,
                                                                              "candidate")
        record["candidate"] = str(candidate.version)
        record["candidate_fingerprint"] = candidate.tags.get(audit.FINGERPRINT_TAG)
    except Exception as err:  # no candidate is a finding, not a crash
        record["candidate"] = f"none ({str(err)[:100]})"
    return record


def rerun(stack: Stack, timeout: float) -> tuple[dict[str, Any], float]:
    """The rerun with everything up, repeated while it fails (MAX_RERUNS in all)."""
    for attempt in range(1, MAX_RERUNS + 1):
        offset, start = _log_offset(stack), time.monotonic()
        flow_run = nightly.start(stack.api)
        final = nightly.wait(stack.api, flow_run, timeout)
        seconds = time.monotonic() - start
        record = _after_rerun(stack, final, offset)
        record.update(reruns=attempt, rerun_s=round(seconds, 1), rerun_flow_run=flow_run)
        if final["type"] == "COMPLETED":
            break
    return record, start + seconds


def schedule(runs: int, rng: random.Random) -> list[tuple[str, str | None]]:
    """(target, registration point) per run: the targets in turn, `registration` twice per turn
    (its points in turn), shuffled; every target is hit once `runs` reaches 7."""
    turn = [t for t in kills.TARGETS if t != "registration"] + ["registration", "registration"]
    targets = [turn[i % len(turn)] for i in range(runs)]
    rng.shuffle(targets)
    points = iter(list(POINTS) * runs)
    return [(t, next(points) if t == "registration" else None) for t in targets]


def chaos_run(stack: Stack, number: int, rng: random.Random, calibration: float,
              target: str, point: str | None) -> dict[str, Any]:
    """One change, one nightly run with one kill (at a random moment, or at `point` of the
    registration), one rerun."""
    nightly.change(stack.repo, seed=1000 + number)
    delay = 0.0 if point else rng.uniform(0.02, 0.95) * calibration
    if point:
        (stack.window_dir / "armed").write_text(point)
    start = time.monotonic()
    flow_run = nightly.start(stack.api)
    done = _kill_during(stack, flow_run, target, delay)
    (stack.window_dir / "armed").unlink(missing_ok=True)
    first = nightly.wait(stack.api, flow_run, timeout=3 * calibration + 600)
    if done is not None and point:
        delay = done.at - start
    record: dict[str, Any] = {
        "run": number, "target": target, "kill_after_s": round(delay, 1),
        "killed": done.what if done else None,
        "restarted_s": round(done.restarted_s, 1) if done else None,
        "first_state": first["name"], "first_message": first["message"],
        "run_s": round(time.monotonic() - start, 1)}
    record["flow_run"] = flow_run
    result, finished = rerun(stack, timeout=3 * calibration + 600)
    record.update(result)
    record["recovery_s"] = round(finished - done.at, 1) if done else None
    return record


def machine() -> str:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines()
                  if line.startswith("Model name")), platform.processor())
    cpus = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
    return f"{model}, {cpus} CPUs"


def table(runs: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    """The per-run table and the summary, as markdown."""
    lines = ["| run | killed | after s | first run | rerun | reruns | rerun result | recovery s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        result = ("up to date" if r.get("up_to_date") else
                  f"registered v{r['registered']}" if r.get("registered") else "-")
        killed = f"{r['target']}: {r['killed']}" if r.get("killed") else (
            r["target"] if r["target"] == "none" else f"{r['target']}: nothing (run ended first)")
        lines.append(f"| {r['run']} | {killed} | {r.get('kill_after_s', '-')} | "
                     f"{r['first_state']} | {r['rerun_state']} | {r.get('reruns', '-')} | "
                     f"{result} | {r.get('recovery_s') or '-'} |")
    s = summary
    lines += ["", "| runs | kills | versions registered | lost | duplicated | half-registered "
              "| candidate behind | reruns failed | longest recovery s |",
              "|---|---|---|---|---|---|---|---|---|",
              f"| {s['runs']} | {s['kills']} | {s['versions']} | {len(s['lost'])} | "
              f"{sum(n - 1 for n in s['duplicated'].values())} | {len(s['half_registered'])} | "
              f"{len(s['candidate_behind'])} | {len(s['reruns_failed'])} | "
              f"{s['longest_recovery_s']} |"]
    return "\n".join(lines)


def _header(args: argparse.Namespace, began: float) -> dict[str, Any]:
    return {"date": time.strftime("%Y-%m-%d %H:%M %Z", time.localtime(began)),
            "machine": machine(),
            "command": f"python -m benchmarks.chaos.run --runs {args.runs} --seed {args.seed}"}


def _write(path: Path, result: dict[str, Any]) -> None:
    path.write_text(json.dumps(result, indent=1) + "\n")


def run_all(stack: Stack, args: argparse.Namespace, result: dict[str, Any]) -> None:
    """Warm-up, calibration, the chaos runs (results written after each), then the audit."""
    rng, runs = random.Random(args.seed), result["runs"]
    for label in ("warm-up", "calibration"):
        if label == "calibration":
            nightly.change(stack.repo, seed=1000)
        runs.append(quiet_run(stack, label))
        print(json.dumps(runs[-1]), flush=True)
    result["calibration_run_s"] = calibration = runs[-1]["run_s"]
    for number, (target, point) in enumerate(schedule(args.runs, rng), start=1):
        runs.append(chaos_run(stack, number, rng, calibration, target, point))
        print(json.dumps(runs[-1]), flush=True)
        _write(args.out, result)
    result["summary"] = audit.summarize(runs, audit.gather(stack.pg, stack.uri, stack.model))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.chaos.run",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="chaos runs (0: calibrate only)")
    parser.add_argument("--seed", type=int, default=0, help="draws the targets and moments")
    parser.add_argument("--out", type=Path, default=HERE / "results.json")
    parser.add_argument("--keep", action="store_true", help="keep the stack's folder")
    args = parser.parse_args()
    began, home = time.time(), Path(tempfile.mkdtemp(prefix="chaos-"))
    result: dict[str, Any] = {**_header(args, began), "runs": []}
    stack = Stack(home)
    try:
        stack.start()
        os.environ["MLFLOW_TRACKING_URI"] = stack.uri  # this process's own MLflow calls,
        os.environ.update(pipeline_credentials())      # as the pipeline's user
        print(f"stack up in {time.time() - began:.0f} s (in {home})", flush=True)
        run_all(stack, args, result)
    finally:
        stack.stop()
        result["wall_s"] = round(time.time() - began)
        _write(args.out, result)
    print(table(result["runs"], result["summary"]))
    print(json.dumps(result["summary"], indent=1))
    if not args.keep:
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
