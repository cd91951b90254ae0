"""FLUX.1-dev LoRA steps on one GPU: the train stage on an nf4 or int8 base against diffusers'
train_dreambooth_lora_flux.py on the bf16 base (the script has no quantization).

    python -m benchmarks.flux_dev.gpu --base /tmp/flux1-dev --loops theirs nf4 int8 --steps 8 --warmup 3

The base is benchmarks/flux_dev/build.py's FLUX.1-dev (built first when missing), with T5-XXL cut
to 2 of its 24 layers (`--t5-layers`): both loops encode the prompt once and release the text
encoders before the first step, so T5's depth changes loading time only, not a step or its memory.
Both loops: 4 images of 512 px at 512 px, batch 1, LoRA rank 16 on to_k, to_q, to_v, to_out.0,
bf16, gradient checkpointing, max_sequence_length 512, learning rate 1e-4 constant, seed 0.
Ours runs `tasks.train.core.train` (the stage's work, without the CLI's MLflow logging) in a
process of its own; theirs is the script unchanged (`--cache_latents` not passed: it encodes each
step's image with the VAE). benchmarks/steptimer.py times both: s/step is the median interval
between optimizer steps after the warm-up; peak GPU memory is torch's allocator's peak within the
timed steps, and over the whole run (loading and the text encoders included).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

from benchmarks.sd35.train import PROMPT, make_images
from benchmarks.steptimer import timed

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TARGETS = "to_k,to_q,to_v,to_out.0"  # the FLUX family's LoRA targets (tasks/common/families/flow.py)


def run_ours(args: argparse.Namespace) -> None:
    from tasks.train.config import TrainConfig
    from tasks.train.core import train

    cfg = TrainConfig(method="lora", instance_prompt=PROMPT, rank=args.rank, base_model_precision=args.precision,
                      resolution=args.resolution, train_batch_size=1, max_train_steps=args.steps, learning_rate=1e-4,
                      gradient_checkpointing=True, max_sequence_length=512, with_prior_preservation=False,
                      num_validation_images=0, fuse_lora=False, mixed_precision="bf16", cache_latents=True,
                      cache_text_encoder_outputs=True, checkpointing_steps=10 ** 6,
                      checkpoints_dir=args.work / "checkpoints", seed=0)
    outcome = train(cfg, args.base, args.data, None, args.work / f"ours-{args.precision}")
    report = outcome.report()
    (args.work / f"ours-{args.precision}-report.json").write_text(json.dumps(
        {k: report[k] for k in ("base_model_precision", "quantized_layers", "final_loss", "peak_rss_mb_by_phase")
         if k in report}))


def theirs_command(args: argparse.Namespace, images: Path) -> list[str]:
    from benchmarks.diffusers_scripts import script

    return [str(script("train_dreambooth_lora_flux.py")), "--pretrained_model_name_or_path", str(args.base),
            "--instance_data_dir", str(images), "--instance_prompt", PROMPT, "--output_dir",
            str(args.work / "theirs-out"), "--resolution", str(args.resolution), "--center_crop",
            "--train_batch_size", "1", "--max_train_steps", str(args.steps), "--learning_rate", "1e-4",
            "--lr_scheduler", "constant", "--mixed_precision", "bf16", "--rank", str(args.rank),
            "--lora_layers", TARGETS, "--gradient_checkpointing", "--max_sequence_length", "512",
            "--checkpointing_steps", str(10 ** 6), "--seed", "0", "--report_to", "tensorboard"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", nargs="?", choices=["compare", "ours"], default="compare")
    parser.add_argument("--base", type=Path, default=Path("/tmp/flux1-dev"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/flux1-dev-gpu"))
    parser.add_argument("--data", type=Path, help="ours: the imagefolder")
    parser.add_argument("--precision", default="nf4", help="ours: train.base_model_precision")
    parser.add_argument("--loops", nargs="+", default=["theirs", "nf4", "int8"])
    parser.add_argument("--t5-layers", type=int, default=2)
    parser.add_argument("--resolution", type=int, default=512)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--results", type=Path, default=HERE / "results_gpu.json")
    args = parser.parse_args()
    if args.mode == "ours":
        run_ours(args)
        return
    if not (args.base / "parameters.json").is_file():
        from benchmarks.flux_dev.build import build_flux_dev

        start = time.perf_counter()
        build_flux_dev(args.base, t5_layers=args.t5_layers)
        print(f"built {args.base} in {time.perf_counter() - start:.0f} s", flush=True)
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    data, images = make_images(args.work, 4)
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    results = json.loads(args.results.read_text()) if args.results.is_file() else []
    for loop in args.loops:
        if loop == "theirs":
            command = theirs_command(args, images)
        else:
            command = ["-m", "benchmarks.flux_dev.gpu", "ours", "--precision", loop, "--base", str(args.base),
                       "--work", str(args.work), "--data", str(data), "--steps", str(args.steps),
                       "--resolution", str(args.resolution), "--rank", str(args.rank)]
        row = {"model": "flux.1-dev", "t5_layers": args.t5_layers, "loop": loop,
               "base": "bf16" if loop == "theirs" else loop, "resolution": args.resolution, "rank": args.rank,
               "steps": args.steps, "warmup": args.warmup, "date": time.strftime("%Y-%m-%d"),
               "device": _device(), "cpu": platform.processor() or platform.machine(),
               "sdpa_disabled": os.environ.get("STEPTIMER_SDPA_DISABLE", "")}
        try:
            row.update(timed(loop, command, args.work, args.warmup, env))
        except SystemExit as failed:
            row["error"] = str(failed)[-1500:]
        report = args.work / f"ours-{loop}-report.json"
        if report.is_file():
            row["report"] = json.loads(report.read_text())
        print(json.dumps(row), flush=True)
        results.append(row)
        args.results.write_text(json.dumps(results, indent=1) + "\n")


def _device() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


if __name__ == "__main__":
    sys.exit(main())
