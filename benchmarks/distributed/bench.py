"""1 rank vs 2 ranks (real mpirun, gloo) through the stage's own CLI, `python -m tasks.train`.

    python benchmarks/distributed/bench.py --resolutions 64 128 --steps 40   # appends to results.json
    python benchmarks/distributed/bench.py --table                           # README's table

Each cell is one `python -m tasks.train` run on the built-in tiny SD (DreamBooth with prior
preservation: each example is 1 instance + 1 class image) with `launcher: local` or
`launcher: mpirun`, `threads_per_process` set explicitly (OMP/MKL threads of each rank). Speed is
rank 0's median optimizer-step time from reports/train.json (the first steps, which fill the
caches, do not move a median of 40); images/s = images per step / median step time. The load
average is recorded before and after each cell (the machine may be shared).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
RESULTS = Path(__file__).with_name("results.json")
#: (name, processes, batch per rank, threads per rank)
CELLS = [
    ("1 rank, batch 1, 1 thread", 1, 1, 1),
    ("1 rank, batch 2, 1 thread", 1, 2, 1),
    ("1 rank, batch 2, 2 threads", 1, 2, 2),
    ("2 ranks x batch 1, 1 thread each", 2, 1, 1),
]


def make_inputs(root: Path) -> tuple[Path, Path, Path]:
    import numpy as np
    from PIL import Image

    from tasks.common.families import build_tiny_pipeline

    base = build_tiny_pipeline("builtin:tiny-sd", 0, root / "base")
    folders = []
    for name, prompt, seed in (("instances", "a photo of sks toy", 0), ("class", "a photo of a toy", 1)):
        folder = root / name
        folder.mkdir()
        rng = np.random.default_rng(seed)
        with open(folder / "metadata.jsonl", "w") as fh:
            for i in range(8):
                small = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
                Image.fromarray(small).resize((256, 256), Image.Resampling.BICUBIC).save(folder / f"{i}.png")
                fh.write(json.dumps({"file_name": f"{i}.png", "text": prompt}) + "\n")
        folders.append(folder)
    return base, folders[0], folders[1]


def cell(root: Path, inputs: tuple[Path, Path, Path], resolution: int, steps: int, processes: int, batch: int,
         threads: int) -> dict:
    base, instances, classes = inputs
    work = Path(tempfile.mkdtemp(dir=root))
    section = {"max_train_steps": steps, "train_batch_size": batch, "resolution": resolution,
               "num_validation_images": 0, "checkpointing_steps": 100_000, "checkpoints_dir": str(work / "ckpt"),
               "system_metrics_interval": 0, "resume": "none",
               "launcher": "mpirun" if processes > 1 else "local",
               "launch": {"num_processes": processes, "threads_per_process": threads}}
    (work / "params.yaml").write_text(yaml.safe_dump({"train": section}))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(threads),
           "MKL_NUM_THREADS": str(threads), "MLFLOW_TRACKING_URI": f"sqlite:///{work / 'mlflow.db'}"}
    load_before = os.getloadavg()
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "tasks.train", "--base", str(base), "--data", str(instances), "--class-data",
         str(classes), "--out", str(work / "out"), "--report", str(work / "train.json"), "--plot",
         str(work / "loss.csv"), "--params", str(work / "params.yaml")],
        capture_output=True, text=True, env=env, cwd=work)
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    report = json.loads((work / "train.json").read_text())
    images_per_step = 2 * batch * processes  # instance + class image per example
    return {"resolution": resolution, "steps": steps, "processes": processes, "batch_per_rank": batch,
            "threads_per_rank": threads, "median_step_s": report["median_step_seconds"],
            "images_per_s": round(images_per_step / report["median_step_seconds"], 2),
            "wall_s": round(time.perf_counter() - start, 1),
            "load_before": [round(x, 2) for x in load_before], "load_after": [round(x, 2) for x in os.getloadavg()],
            "when": time.strftime("%Y-%m-%d %H:%M:%S")}


def table(results: list[dict]) -> str:
    lines = ["| px | cell | median s/step | images/s | load avg (1 min) before/after |", "|---|---|---|---|---|"]
    for r in results:
        name = (f"{r['processes']} rank{'s' if r['processes'] > 1 else ''} x batch {r['batch_per_rank']}, "
                f"{r['threads_per_rank']} thread{'s' if r['threads_per_rank'] > 1 else ''} per rank")
        lines.append(f"| {r['resolution']} | {name} | {r['median_step_s']:.4f} | {r['images_per_s']:.1f} | "
                     f"{r['load_before'][0]:.2f} / {r['load_after'][0]:.2f} |")
    by = {(r["resolution"], r["processes"], r["batch_per_rank"], r["threads_per_rank"]): r for r in results}
    for px in sorted({r["resolution"] for r in results}):
        one, two = by.get((px, 1, 1, 1)), by.get((px, 2, 1, 1))
        if one and two:
            eff = two["images_per_s"] / (2 * one["images_per_s"])
            lines.append(f"\n{px} px: scaling efficiency (2 ranks x batch 1) / (2 x 1 rank x batch 1), "
                         f"1 thread per rank: {eff:.0%}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--resolutions", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--table", action="store_true", help="print the table from results.json")
    args = parser.parse_args()
    results = json.loads(RESULTS.read_text()) if RESULTS.is_file() else []
    if not args.table:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            inputs = make_inputs(root)
            for px in args.resolutions:
                for name, processes, batch, threads in CELLS:
                    result = cell(root, inputs, px, args.steps, processes, batch, threads)
                    print(name, px, "px:", json.dumps(result), flush=True)
                    results.append(result)
                    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))


if __name__ == "__main__":
    main()
