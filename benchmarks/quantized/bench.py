"""A LoRA on a quantized frozen base, library against library: step time, peak memory and loss drift.

    python -m benchmarks.quantized.bench --steps 6 --warmup 2                 # every precision, then the table
    python -m benchmarks.quantized.bench one --precision int8 --steps 6 --warmup 2   # one process, JSON on stdout

The model is the SD 1.5 architecture with seeded random weights (benchmarks/train/bench.py
`base_for`, or `--base`); 2 instance images at 512 px, trained at 256 px through the train stage
itself (tasks.train.core.train): LoRA rank 16, bf16, latents and prompts cached, no prior
preservation, the same seed and data for every precision. Each precision runs in its own process
(peak RSS is that run's alone). The loss drift is how far each step's loss is from the same step's
loss on the unquantized (bf16) base: same noise, same timesteps, same batch, so what differs is the
base's weights.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
RESULTS = Path(__file__).with_name("results.json")
PRECISIONS = ("none", "int8", "int8-quanto", "int8-bnb", "fp8", "fp8-quanto", "nf4")


def one(precision: str, steps: int, warmup: int, base: Path | None, lora_type: str) -> dict:
    import resource

    import torch

    from benchmarks.train.bench import base_for, make_data
    from tasks.common.allocator import in_use
    from tasks.train.config import TrainConfig
    from tasks.train.core import train

    base = base or base_for("sd15")
    with tempfile.TemporaryDirectory() as tmp:
        data, _ = make_data(Path(tmp))
        cfg = TrainConfig(method="lora", rank=16, lora_type=lora_type, base_model_precision=precision,
                          resolution=256, train_batch_size=1, max_train_steps=warmup + steps, learning_rate=1e-4,
                          with_prior_preservation=False, num_validation_images=0, fuse_lora=False,
                          mixed_precision="auto", cache_latents=True, cache_text_encoder_outputs=True,
                          checkpointing_steps=10**6, checkpoints_dir=Path(tmp) / "ckpt")
        start, cpu = time.perf_counter(), time.process_time()
        outcome = train(cfg, base, data, None, Path(tmp) / "out")
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    times = [h.seconds for h in outcome.history]
    return {"precision": precision, "lora_type": lora_type, "steps": steps, "warmup": warmup,
            "median_step_s": round(statistics.median(times[warmup:]), 3), "step_s": [round(t, 3) for t in times],
            "losses": [h.loss for h in outcome.history], "load_and_loop_s": round(outcome.seconds, 1),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            "wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "threads": torch.get_num_threads(), "allocator": in_use()}


def compare(precisions: list[str], steps: int, warmup: int, base: Path | None, lora_type: str) -> list[dict]:
    rows = []
    for precision in precisions:
        cmd = [sys.executable, "-m", "benchmarks.quantized.bench", "one", "--precision", precision, "--steps",
               str(steps), "--warmup", str(warmup), "--lora-type", lora_type, *(["--base", str(base)] if base else [])]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        if proc.returncode != 0:
            row = {"precision": precision, "error": proc.stderr.strip().splitlines()[-1][:300]}
        else:
            row = json.loads(proc.stdout.strip().splitlines()[-1])
        row.update(load_avg=os.getloadavg(), cpu=platform.processor() or platform.machine())
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    ref = next((r for r in rows if r.get("precision") == "none" and "losses" in r), None)
    lines = ["| base_model_precision | s/step, median (min-max) | peak RSS MB | loss drift vs bf16: mean (max) |",
             "|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['precision']} | failed: {r['error']} | | |")
            continue
        timed = r["step_s"][r["warmup"]:]
        drift = "-"
        if ref is not None and r is not ref:
            rel = [abs(a - b) / abs(b) for a, b in zip(r["losses"], ref["losses"])]
            drift = f"{statistics.mean(rel):.2%} ({max(rel):.2%})"
        lines.append(f"| {r['precision']} | {r['median_step_s']:.2f} ({min(timed):.2f}-{max(timed):.2f}) | "
                     f"{r['peak_rss_mb']} | {drift} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", nargs="?", choices=["compare", "one"], default="compare")
    parser.add_argument("--precision", default="none")
    parser.add_argument("--precisions", default=",".join(PRECISIONS))
    parser.add_argument("--lora-type", default="lora")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--base", type=Path)
    args = parser.parse_args()
    if args.mode == "one":
        print(json.dumps(one(args.precision, args.steps, args.warmup, args.base, args.lora_type)))
        return
    rows = compare(args.precisions.split(","), args.steps, args.warmup, args.base, args.lora_type)
    kept = {r["precision"]: r for r in (json.loads(RESULTS.read_text()) if RESULTS.is_file() else [])}
    kept.update({r["precision"]: r for r in rows})  # a rerun of some precisions replaces their rows only
    rows = [kept[p] for p in PRECISIONS if p in kept] + [r for p, r in kept.items() if p not in PRECISIONS]
    RESULTS.write_text(json.dumps(rows, indent=1) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
