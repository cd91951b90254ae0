"""Seconds per optimizer step and peak RSS of each `train.optimizer` on SD 1.5's UNet (random weights).

    .venv/bin/python -m benchmarks.optimizers.bench --modes lora full --steps 3

Each (optimizer, mode) runs in a process of its own: SD 1.5's UNet architecture with random weights
(benchmarks/train `base_for("sd15")`), trained tensors given seeded random gradients, then one
warm-up step and `--steps` timed steps of the optimizer the train stage builds (tasks/train/optim.py
`make_optimizer`). `full`: every UNet weight (860M, float32); `lora`: peft LoRA rank 16 on the
attention projections (as `method: lora`), the UNet frozen. Peak RSS is the process's.
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

from tasks.train.sections.optimizer import OPTIMIZERS

#: each optimizer's usual learning rate (Prodigy's multiplies its own estimate)
RATES = {"adamw": 1e-5, "adamw8bit": 1e-5, "prodigy": 1.0, "adafactor": 1e-3, "schedulefree_adamw": 1e-5,
         "lion": 3e-6}


def _trained(mode: str) -> list:
    import torch
    from diffusers import UNet2DConditionModel

    from benchmarks.train.bench import base_for

    torch.manual_seed(0)
    unet = UNet2DConditionModel.from_pretrained(base_for("sd15"), subfolder="unet")
    if mode == "lora":
        from peft import LoraConfig

        unet.requires_grad_(False)
        unet.add_adapter(LoraConfig(r=16, lora_alpha=16, target_modules=["to_k", "to_q", "to_v", "to_out.0"]))
    params = [p for p in unet.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    return params


def one(optimizer: str, mode: str, steps: int) -> dict:
    """The child: build what trains, time the optimizer's steps after a warm-up."""
    import torch

    from tasks.train.config import TrainConfig
    from tasks.train.optim import make_optimizer, set_training

    params = _trained(mode)
    cfg = TrainConfig(optimizer=optimizer, learning_rate=RATES[optimizer])
    opt = make_optimizer(cfg, [{"params": params}], cfg.learning_rate)
    set_training(opt, True)
    opt.step()  # warm-up: allocates the states
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    return {"trained_m": round(sum(p.numel() for p in params) / 1e6, 2), "step_s_median": round(
        statistics.median(times), 3), "step_s": [round(t, 3) for t in times], "threads": torch.get_num_threads(),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=OPTIMIZERS)
    parser.add_argument("--modes", nargs="+", default=["lora", "full"], choices=["lora", "full"])
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--report", type=Path, default=Path("benchmarks/optimizers/results.json"))
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one[0], args.one[1], args.steps)))
        return
    rows: dict = {}
    for mode in args.modes:
        for name in args.optimizers:
            cmd = [sys.executable, "-m", "benchmarks.optimizers.bench", "--one", name, mode, "--steps", str(args.steps)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            tail = done.stderr.strip().splitlines()
            rows[f"{mode}/{name}"] = (json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0
                                      else {"error": tail[-1] if tail else "failed"})
            print(mode, name, rows[f"{mode}/{name}"], flush=True)
    report = {"command": "python -m benchmarks.optimizers.bench " + " ".join(sys.argv[1:]), "cpus": os.cpu_count(),
              "results": rows}
    args.report.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
