"""Masked against unmasked training: step time and peak memory, same model, data and seeds.

    python -m benchmarks.train.masked --runs 3 --steps 4 --warmup 2      # SD 1.5 architecture, 256 px, LoRA
    python -m benchmarks.train.masked one --masked 1 --steps 4 --warmup 2  # one process, JSON on stdout
    python -m benchmarks.train.masked overhead     # the mask's own work per step, no model (quiet figures)

Each run is its own process (peak RSS is that run's alone), masked and unmasked in turn (A B A B:
a drifting machine speed hits both alike). The model is the SD 1.5 architecture with seeded random
weights (benchmarks/train/bench.py `base_for`, or `--base`), 2 instance images with a subject mask
(an ellipse covering about half the image) and 2 class images at 512 px, trained at 256 px through
the stage's own loop (tasks.train.loop.run_loop) with its defaults: latents and prompts cached,
bf16, channels_last, prior preservation (class rows train unmasked).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
RESULTS = Path(__file__).with_name("results_masked.json")


def add_masks(folder: Path) -> None:
    """An ellipse mask per image of an imagefolder, listed as `mask_file_name` (as the ingest writes it)."""
    from PIL import Image, ImageDraw

    rows = [json.loads(line) for line in (folder / "metadata.jsonl").read_text().splitlines()]
    (folder / "masks").mkdir(exist_ok=True)
    for row in rows:
        with Image.open(folder / row["file_name"]) as im:
            w, h = im.size
        mask = Image.new("L", (w, h), 0)
        ImageDraw.Draw(mask).ellipse((w // 5, h // 8, w - w // 5, h - h // 8), fill=255)
        row["mask_file_name"] = f"masks/{Path(row['file_name']).stem}.png"
        row["mask_source"] = "file"
        mask.save(folder / row["mask_file_name"])
    (folder / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def one(masked: bool, steps: int, warmup: int, base: Path | None, method: str) -> dict:
    import resource

    import torch

    from benchmarks.train.bench import base_for, config, make_data, our_loop
    from tasks.common.allocator import in_use

    base = base or base_for("sd15")
    with tempfile.TemporaryDirectory() as tmp:
        data, class_dir = make_data(Path(tmp))
        add_masks(data)
        cfg = config(method, "sd15", "ours", warmup + steps).model_copy(update={"masked_loss": masked})
        start = time.perf_counter()
        times = our_loop(cfg, base, data, class_dir)
        wall = time.perf_counter() - start
    timed = times[warmup:]
    return {"masked": masked, "method": method, "resolution": cfg.resolution, "steps": steps, "warmup": warmup,
            "median_step_s": round(statistics.median(timed), 4), "step_s": [round(t, 4) for t in times],
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            "wall_s": round(wall, 1), "threads": torch.get_num_threads(), "allocator": in_use()}


def compare(runs: int, steps: int, warmup: int, base: Path | None, method: str) -> list[dict]:
    import os
    import platform

    rows = []
    for run in range(runs):
        for masked in (1, 0):
            cmd = [sys.executable, "-m", "benchmarks.train.masked", "one", "--masked", str(masked), "--steps",
                   str(steps), "--warmup", str(warmup), "--method", method,
                   *(["--base", str(base)] if base else [])]
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, check=True)
            row = {**json.loads(proc.stdout.strip().splitlines()[-1]), "run": run, "load_avg": os.getloadavg(),
                   "cpu": platform.processor() or platform.machine()}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def overhead(repeats: int = 200) -> list[str]:
    """What the mask adds per example, in this process (no model): the data loader's mask crop and the
    loss's weights and weighted mean, against the unmasked loss, at the latent shapes of SD 1.5 and FLUX."""
    import numpy as np
    import torch
    from PIL import Image

    from tasks.train.data import prepare_mask
    from tasks.train.diffusion import per_example_loss
    from tasks.train.masks import loss_weights

    def best(func, *args) -> float:  # ms, the fastest of `repeats` calls: the least disturbed by other work
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            func(*args)
            times.append(time.perf_counter() - start)
        return min(times) * 1e3

    def masked_loss(pred, target, masks, mask_off):
        return per_example_loss(pred, target, None, None, None, loss_weights(cfg, masks, mask_off, pred))

    cfg = type("Cfg", (), {"masked_loss": True, "masked_loss_unmasked_weight": 0.0,
                           "normalize_masked_area_loss": True})()
    rows = ["| shape (px -> latent) | mask crop in the loader ms | unmasked loss ms | masked loss (weights + mean) "
            "ms |", "|---|---|---|---|"]
    for label, px, shape in (("SD 1.5, 256 px", 256, (2, 4, 32, 32)), ("SD 1.5, 512 px", 512, (2, 4, 64, 64)),
                             ("FLUX, 1024 px", 1024, (1, 16, 128, 128))):
        image = Image.fromarray((np.random.default_rng(0).random((px * 2, px * 2)) > 0.5).astype(np.uint8) * 255)
        crop = best(prepare_mask, image, (px * 2, px * 2), (px, px), (0, 0), True)
        pred, target = torch.randn(shape), torch.randn(shape)
        mask = prepare_mask(image, (px * 2, px * 2), (px, px), (0, 0), True)
        plain = best(per_example_loss, pred, target, None, None, None)
        masked = best(masked_loss, pred, target, [mask] * shape[0], [False] * shape[0])
        rows.append(f"| {label} {shape} | {crop:.2f} | {plain:.3f} | {masked:.3f} |")
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| loss | runs | s/step: median of runs (min-max of runs) | peak RSS MB: median (min-max) |",
             "|---|---|---|---|"]
    for masked in (True, False):
        mine = [r for r in rows if bool(r["masked"]) == masked]
        if not mine:
            continue
        s, m = [r["median_step_s"] for r in mine], [r["peak_rss_mb"] for r in mine]
        lines.append(f"| {'masked' if masked else 'unmasked'} | {len(mine)} | {statistics.median(s):.3f} "
                     f"({min(s):.3f}-{max(s):.3f}) | {statistics.median(m):.0f} ({min(m)}-{max(m)}) |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cmd", nargs="?", choices=["compare", "one", "table", "overhead"], default="compare")
    parser.add_argument("--masked", type=int, choices=[0, 1], default=1)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed first steps")
    parser.add_argument("--method", default="lora", choices=["dreambooth", "lora"])
    parser.add_argument("--base", type=Path, default=None, help="an SD 1.5-architecture folder (default: built)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.cmd == "one":
        import logging

        logging.disable(logging.WARNING)
        print(json.dumps(one(bool(args.masked), args.steps, args.warmup, args.base, args.method)))
    elif args.cmd == "overhead":
        print("\n".join(overhead()))
    elif args.cmd == "table":
        print(table(json.loads(args.out.read_text())))
    else:
        rows = compare(args.runs, args.steps, args.warmup, args.base, args.method)
        args.out.write_text(json.dumps(rows, indent=1) + "\n")
        print(table(rows))


if __name__ == "__main__":
    main()
