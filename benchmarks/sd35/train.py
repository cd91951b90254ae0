"""SD3.5 Medium LoRA training steps: our train stage against diffusers' train_dreambooth_lora_sd3.py.

    .venv/bin/python benchmarks/diffusers_scripts.py              # once: the reference scripts
    make bench-env                                                 # once: .venv-bench (torchvision)
    .venv-bench/bin/python -m benchmarks.sd35.train --runs 3      # appends to results_train.json
    .venv-bench/bin/python -m benchmarks.sd35.train --table       # the README's table

Both run in .venv-bench (the project's pins plus torch 2.13's PyPI build and torchvision 0.28,
which diffusers' scripts import and the project's CPU build of torch cannot load), one after the
other, each in its own process, on the same model folder (benchmarks/sd35/build.py), the same
images, resolution, batch, precision, LoRA rank and targets, learning rate and number of steps.
Both are timed by the same hook (benchmarks/steptimer.py): s/step is the median interval
between optimizer steps after the warm-up steps; peak RSS is the process's, at the last step and
at exit (loading, saving and the final pipeline included).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

import yaml

from benchmarks.steptimer import add_run_arguments, compute_precision, mixed_precision, timed

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PROMPT = "a photo of sks toy"
#: train_dreambooth_lora_sd3.py's --lora_layers spelled for our targets (SD3's: the image stream's
#: attention projections), so both train the same adapters.
LORA_LAYERS = "attn.to_k,attn.to_q,attn.to_v,attn.to_out.0"
# Not passed to theirs: --cache_latents. With --mixed_precision bf16 the v0.39.0 script casts the
# images to bf16 for its fp32 VAE and stops (RuntimeError: Input type (c10::BFloat16) and bias type
# (float) should be the same); without it the VAE encodes each step's image (small at 256 px).


def make_images(work: Path, n: int) -> tuple[Path, Path]:
    """An imagefolder for our stage (images + metadata.jsonl) and the same images alone for theirs."""
    sys.path.insert(0, str(ROOT))
    from tests.train.conftest import write_imagefolder

    ours = write_imagefolder(work / "instance", n, PROMPT, 0, size=(512, 512))
    theirs = work / "instance-images"
    theirs.mkdir(exist_ok=True)
    for image in ours.glob("*.png"):
        shutil.copy(image, theirs / image.name)
    return ours, theirs


def ours_command(base: Path, work: Path, data: Path, args: argparse.Namespace) -> list[str]:
    train = dict(
        method="lora", instance_prompt=PROMPT, with_prior_preservation=False, resolution=args.resolution,
        train_batch_size=1, max_train_steps=args.steps, learning_rate=1e-4, rank=args.rank,
        mixed_precision=mixed_precision(compute_precision(args.compute)),
        checkpointing_steps=10 ** 6, validation_prompts=[], num_validation_images=0, validation_steps=0,
        checkpoints_dir=str(work / "checkpoints"), resume="none", seed=0, base_model_precision=args.precision,
        text_encoder_precision=args.text_precision,
    )
    params = work / "params.yaml"
    params.write_text(yaml.safe_dump({"train": train}))
    (work / "empty-class").mkdir(exist_ok=True)
    return ["-m", "tasks.train", "--base", str(base), "--data", str(data), "--class-data", str(work / "empty-class"),
            "--out", str(work / "ours-out"), "--report", str(work / "ours-report.json"),
            "--plot", str(work / "ours-loss.csv"), "--params", str(params)]


def theirs_command(base: Path, work: Path, images: Path, args: argparse.Namespace) -> list[str]:
    from benchmarks.diffusers_scripts import script

    return [str(script("train_dreambooth_lora_sd3.py")), "--pretrained_model_name_or_path", str(base),
            "--instance_data_dir", str(images), "--instance_prompt", PROMPT, "--output_dir", str(work / "theirs-out"),
            "--resolution", str(args.resolution), "--center_crop", "--train_batch_size", "1",
            "--max_train_steps", str(args.steps), "--learning_rate", "1e-4", "--lr_scheduler", "constant",
            "--mixed_precision", mixed_precision(compute_precision(args.compute)), "--rank", str(args.rank),
            "--lora_layers", LORA_LAYERS,
            "--checkpointing_steps", str(10 ** 6), "--seed", "0", "--report_to", "mlflow"]


def table(results: list[dict]) -> str:
    """Markdown: per loop (and label), the median s/step over runs with its range, and the peak RSS range."""
    rows = ["| loop | runs | s/step median (min-max over runs) | peak RSS at last step, GB | peak RSS at exit, GB |",
            "|---|---|---|---|---|"]
    groups = list(dict.fromkeys((r["loop"], r.get("label", "")) for r in results))  # in the order they were first run
    for loop, label in sorted(groups, key=lambda g: g[0] != "ours"):
        cells = [r for r in results if r["loop"] == loop and r.get("label", "") == label]
        name = f"{loop} ({label})" if label else loop
        s = [r["s_per_step"] for r in cells]
        train_rss = [r["peak_rss_train_gb"] for r in cells]
        exit_rss = [r["peak_rss_gb"] for r in cells]
        rows.append(f"| {name} | {len(cells)} | {statistics.median(s):.2f} ({min(s):.2f}-{max(s):.2f}) | "
                    f"{min(train_rss):.1f}-{max(train_rss):.1f} | {min(exit_rss):.1f}-{max(exit_rss):.1f} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path, default=ROOT / ".cache/bench/sd35-medium")
    parser.add_argument("--work", type=Path, default=ROOT / ".cache/bench/sd35-train")
    parser.add_argument("--resolution", type=int, default=256)
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--loops", nargs="+", default=["ours", "theirs"], choices=["ours", "theirs"])
    parser.add_argument("--precision", default="none", help="ours: train.base_model_precision (theirs has none)")
    parser.add_argument("--text-precision", default="none", help="ours: train.text_encoder_precision")
    add_run_arguments(parser, HERE / "results_train.json")
    parser.add_argument("--model", default="sd3.5-medium", help="the model's name in the results")
    parser.add_argument("--ours-root", type=Path, default=ROOT,
                        help="the project tree whose train stage runs as ours (another commit's, for before/after)")
    parser.add_argument("--label", default="", help="a note kept with each result (e.g. the commit of ours)")
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(args.results.read_text())))
        return
    args.base, args.work = args.base.resolve(), args.work.resolve()  # the runs' cwd is the work folder
    if not (args.base / "model_index.json").is_file():
        raise SystemExit(f"{args.base} is missing: run `.venv/bin/python -m benchmarks.sd35.build --out {args.base}`")
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    data, images = make_images(args.work, 4)
    commands = {"ours": ours_command(args.base, args.work, data, args),
                "theirs": theirs_command(args.base, args.work, images, args)}
    results = json.loads(args.results.read_text()) if args.results.is_file() else []
    env = {"MLFLOW_TRACKING_URI": f"sqlite:///{args.work / 'mlflow.db'}", "PYTHONPATH": str(ROOT)}
    for run in range(args.runs):
        for loop in args.loops:
            for leftover in ("ours-out", "theirs-out", "checkpoints"):
                shutil.rmtree(args.work / leftover, ignore_errors=True)
            row = {"run": run, "model": args.model, "method": "lora", "resolution": args.resolution,
                   "batch": 1, "rank": args.rank, "precision": compute_precision(args.compute),
                   "date": time.strftime("%Y-%m-%d"),
                   "base_model_precision": args.precision if loop == "ours" else "none",
                   "text_encoder_precision": args.text_precision if loop == "ours" else "none",
                   "cpu": platform.processor() or platform.machine(), "threads": os.cpu_count(),
                   **({"label": args.label} if args.label else {}),
                   **timed(loop, commands[loop], args.work, args.warmup, {
                       **env, "PYTHONPATH": str(args.ours_root.resolve() if loop == "ours" else ROOT),
                       "STEPTIMER_MEMORY_LOG": str(args.work / f"{loop}-memory.log")})}  # RSS at each log record
            report = args.work / "ours-report.json"
            if loop == "ours" and report.is_file():
                row["peak_rss_mb_by_phase"] = json.loads(report.read_text()).get("peak_rss_mb_by_phase")
            print(json.dumps(row), flush=True)
            results.append(row)
            args.results.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
