"""Loss over 200 steps on the demo subject, one real train-stage run per `train.optimizer`.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.optimizers.losses

The measurement benchmarks/optimizers/README.md ("The full measurement", step 2) describes as a
`dvc exp run` loop, made without touching the repository's params.yaml, dvc.lock, data/ or models/:
in a temporary folder it runs the demo's stages as DVC would (`python -m tasks.base`, `tasks.ingest`,
`tasks.class_images`, each a process of its own, with a copy of params.yaml whose only change is
`ingest.data_dir`), then for each optimizer `python -m tasks.train` in a process and a folder of its
own, with the demo's `train` section changed only by `method: lora`, `max_train_steps`, `optimizer`
and `learning_rate` (the README loop's `-S` overrides; the demo's `lr_scheduler` is already
`constant`, which schedule-free AdamW requires). Everything else is the demo's: the built-in
tiny SD (random weights from `base.seed`), 64 px, batch 2 with prior preservation on the class
images, seed 0 for every run, validation and checkpoints as params.yaml sets them.

The loss history is the stage's own loss CSV (`--plot`: step, loss, lr); the results file has, per
optimizer, the learning rate, the loss at step 1, the mean over steps 1-20, 91-110 and 181-200, the
minimum, the process's wall seconds and the whole history, plus the CPU (lscpu), torch's version
and this command. The demo subject is data/demo/subject when it is there, else
data/demo/generate.py draws it (byte for byte the same) into the temporary folder.
"""
from __future__ import annotations

import argparse
import csv
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
# The README loop's learning rates: each optimizer's usual one (Prodigy's multiplies its own estimate).
OPTIMIZERS = {"adamw": 1e-4, "adamw8bit": 1e-4, "prodigy": 1.0, "adafactor": 1e-3,
              "schedulefree_adamw": 1e-4, "lion": 3e-5}
WINDOWS = {"first_20": (1, 20), "middle_20": (91, 110), "last_20": (181, 200)}


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        out = ""
    for line in out.splitlines():
        if line.strip().startswith("Model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def folder_sha256(folder: Path) -> str:
    """The images and captions (not the dot files: generate.py's output marker, which ingest skips)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith(".")):
        digest.update(path.relative_to(folder).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def stage(args: list[str], cwd: Path, env: dict[str, str], log: Path) -> float:
    """`python -m <args>` in `cwd`, output to `log`; wall seconds. A failure raises with the log's tail."""
    start = time.perf_counter()
    with open(log, "w") as fh:
        done = subprocess.run([sys.executable, "-m", *args], cwd=cwd, env=env, stdout=fh, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - start
    if done.returncode:
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        raise RuntimeError(f"{' '.join(args[:1])} exited {done.returncode} (log {log}):\n{tail}")
    return seconds


def window_mean(losses: list[float], lo: int, hi: int) -> float | None:
    part = losses[lo - 1:hi]
    return round(statistics.fmean(part), 6) if len(part) == hi - lo + 1 else None


def summarize(name: str, lr: float, rows: list[dict[str, str]], seconds: float, report: dict[str, Any]) -> dict:
    steps = [int(r["step"]) for r in rows]
    losses = [float(r["loss"]) for r in rows]
    if steps != list(range(1, len(steps) + 1)):
        raise RuntimeError(f"{name}: the loss CSV's steps are not 1..{len(steps)}")
    return {
        "learning_rate": lr,
        "steps": len(losses),
        "loss_step_1": losses[0] if losses else None,
        **{f"mean_{k}": window_mean(losses, *v) for k, v in WINDOWS.items()},
        "min": min(losses) if losses else None,
        "min_step": steps[losses.index(min(losses))] if losses else None,
        "wall_seconds": round(seconds, 1),
        "median_step_seconds": report.get("median_step_seconds"),
        "optimizer_reported": report.get("optimizer"),
        "history": [[s, loss, float(r["lr"])] for s, loss, r in zip(steps, losses, rows)],
    }


def prepare(work: Path, env: dict[str, str]) -> tuple[Path, dict[str, Any], dict[str, float]]:
    """The demo's base, ingest and class_images stages in `work`: (subject folder, params, seconds per stage)."""
    subject = REPO / "data/demo/subject"
    if not any(subject.glob("*.png")):
        subject = work / "subject"
        subprocess.run([sys.executable, str(REPO / "data/demo/generate.py"), "--out", str(subject)],
                       check=True, env=env)
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["ingest"]["data_dir"] = str(subject)
    (work / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    (work / "logs").mkdir(exist_ok=True)
    seconds = {
        "base": stage(["tasks.base", "--out", "models/base"], work, env, work / "logs/base.log"),
        "ingest": stage(["tasks.ingest", "--out", "data/processed", "--report", "reports/ingest.json",
                         "--rejected", "reports/ingest_rejected.jsonl"], work, env, work / "logs/ingest.log"),
        "class_images": stage(["tasks.class_images", "--base", "models/base", "--out", "data/class_images",
                               "--report", "reports/class_images.json"], work, env, work / "logs/class_images.log"),
    }
    return subject, params, seconds


def train_one(name: str, overrides: dict[str, Any], params: dict[str, Any], work: Path,
              env: dict[str, str]) -> dict[str, Any]:
    """`python -m tasks.train` for one optimizer in `work/runs/<name>`; its summary and loss history."""
    lr = OPTIMIZERS[name]
    run = work / "runs" / name
    run.mkdir(parents=True, exist_ok=True)
    mine = json.loads(json.dumps(params))
    mine["train"].update(overrides, optimizer=name, learning_rate=lr)
    (run / "params.yaml").write_text(yaml.safe_dump(mine, sort_keys=False))
    try:
        seconds = stage(["tasks.train", "--base", str(work / "models/base"), "--data", str(work / "data/processed"),
                         "--class-data", str(work / "data/class_images"), "--out", "models/finetuned",
                         "--report", "reports/train.json", "--plot", "reports/train_loss.csv",
                         "--params", "params.yaml"], run, env, run / "train.log")
    except RuntimeError as err:
        print(name, "FAILED", err, flush=True)
        return {"learning_rate": lr, "error": str(err)[-2000:]}
    with open(run / "reports/train_loss.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    report = json.loads((run / "reports/train.json").read_text())
    return summarize(name, lr, rows, seconds, report)


def paired(results: dict[str, Any], reference: str = "adamw") -> None:
    """Each run's mean of (its loss - `reference`'s at the same step) per window, into `vs_<reference>`.
    Every run draws the same batches, noise and timesteps (one seed, the same draws), so step by step
    the losses differ only by the weights; this takes out the noise the per-step loss shares."""
    if "history" not in results.get(reference, {}):
        return
    ref = [h[1] for h in results[reference]["history"]]
    for row in results.values():
        if "history" in row:
            diff = [h[1] - r for h, r in zip(row["history"], ref)]
            row[f"vs_{reference}"] = {k: window_mean(diff, *v) for k, v in WINDOWS.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=list(OPTIMIZERS))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--report", type=Path, default=REPO / "benchmarks/optimizers/results_losses.json")
    parser.add_argument("--keep", type=Path, default=None, help="work here and keep it (default: a temp folder)")
    args = parser.parse_args()

    work = args.keep or Path(tempfile.mkdtemp(prefix="optloss-"))
    work.mkdir(parents=True, exist_ok=True)
    threads = os.environ.get("OMP_NUM_THREADS", "1")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads,
           "MLFLOW_TRACKING_URI": f"sqlite:///{work / 'mlflow.db'}"}  # not the repository's mlflow.db
    try:
        subject, params, prep = prepare(work, env)
        print("prepared in", work, {k: round(v, 1) for k, v in prep.items()}, flush=True)
        overrides = {"method": "lora", "max_train_steps": args.steps}
        results: dict[str, Any] = {}
        for name in args.optimizers:
            results[name] = train_one(name, overrides, params, work, env)
            print(name, {k: v for k, v in results[name].items() if k != "history"}, flush=True)

        paired(results)
        import torch

        out = {
            "command": "OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.optimizers.losses"
                       + ("" if len(sys.argv) == 1 else " " + " ".join(sys.argv[1:])),
            "cpu": cpu_model(),
            "cpus": os.cpu_count(),
            "threads_per_process": int(threads),
            "torch": torch.__version__,
            "shared_machine_note": "wall seconds were taken on a shared machine (other work running)",
            "subject": {"path": str(subject.relative_to(REPO) if subject.is_relative_to(REPO) else "generated"),
                        "sha256": folder_sha256(subject)},
            "base": params["base"],
            "train_overrides": {**overrides, "optimizer": "<each>", "learning_rate": "<each>"},
            "train_demo": {k: params["train"][k] for k in (
                "resolution", "train_batch_size", "with_prior_preservation", "lr_scheduler", "lr_warmup_steps",
                "adam_weight_decay", "max_grad_norm", "mixed_precision", "seed")},
            "prepare_seconds": {k: round(v, 1) for k, v in prep.items()},
            "windows": {k: list(v) for k, v in WINDOWS.items()},
            "optimizers": results,
        }
        args.report.write_text(json.dumps(out, indent=1) + "\n")
        print("wrote", args.report)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
