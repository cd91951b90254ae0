"""One AdamW step over SD 1.5's UNet weights: fp32 states against 8-bit and 4-bit ones.

    .venv/bin/python -m benchmarks.quantized.optimizers --steps 3 --report benchmarks/quantized/results_optimizers.json

Each optimizer runs in a process of its own over the 860M fp32 parameters of SD 1.5's UNet (random
weights, benchmarks/train `base_for("sd15")`) with seeded random gradients, as a full fine-tune's
step would: seconds per step after one warm-up step, the memory the optimizer's states take (the
process's resident memory after the first step, which allocates them, less before it), and the
process's peak. `adamw` and `bnb-adamw8bit` are what the train stage builds (tasks/train/optim.py
`make_optimizer`, the latter with `train.use_8bit_adam`); torchao's are built directly, with their
default block sizes.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.adapters.bench import cpu_name, rss_mb

CHOICES = ("adamw", "bnb-adamw8bit", "ao-adamw8bit", "ao-adamw4bit")


def one(optimizer: str, steps: int) -> dict[str, float]:
    """The child: build the UNet, give it gradients, time `steps` optimizer steps after a warm-up."""
    import torch
    from diffusers import UNet2DConditionModel

    from benchmarks.train.bench import base_for
    from tasks.common.memory import release_memory
    from tasks.train.config import TrainConfig
    from tasks.train.optim import make_optimizer

    torch.manual_seed(0)
    unet = UNet2DConditionModel.from_pretrained(base_for("sd15"), subfolder="unet")
    params = [p for p in unet.parameters()]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    groups = [{"params": params}]
    if optimizer.startswith("ao-"):
        from torchao.optim import AdamW4bit, AdamW8bit

        opt = (AdamW8bit if optimizer == "ao-adamw8bit" else AdamW4bit)(groups, lr=1e-5)
    else:
        opt = make_optimizer(TrainConfig(use_8bit_adam=optimizer == "bnb-adamw8bit"), groups, 1e-5)
    release_memory()
    before = rss_mb()
    start = time.perf_counter()
    opt.step()
    first = time.perf_counter() - start
    release_memory()
    states = rss_mb() - before
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    return {
        "optimizer": type(opt).__module__ + "." + type(opt).__name__,
        "parameters_m": round(sum(p.numel() for p in params) / 1e6, 1),
        "first_step_s": round(first, 2),
        "step_s_median": round(statistics.median(times), 3),
        "step_s": [round(t, 3) for t in times],
        "state_mb": round(states),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--optimizers", nargs="+", default=list(CHOICES), choices=CHOICES)
    parser.add_argument("--one", choices=CHOICES, help=argparse.SUPPRESS)
    parser.add_argument("--report", type=Path, default=Path("benchmarks/quantized/results_optimizers.json"))
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.steps)))
        return
    rows = {}
    for name in args.optimizers:
        cmd = [sys.executable, "-m", "benchmarks.quantized.optimizers", "--one", name, "--steps", str(args.steps)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            rows[name] = {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "failed"}
        else:
            rows[name] = json.loads(done.stdout.strip().splitlines()[-1])
        print(name, rows[name], flush=True)
    report = {"command": "python -m benchmarks.quantized.optimizers " + " ".join(sys.argv[1:]),
              "cpu": cpu_name(), "cpus": os.cpu_count(),
              "threads": int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)), "optimizers": rows}
    args.report.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
