"""python -m tasks.train --base models/base --data data/processed --class-data data/class_images
    --out models/finetuned --report reports/train.json --plot reports/train_loss.csv [--params params.yaml]

Fine-tunes the base model with `train.method` and writes its output to --out (a full diffusers
pipeline folder; plus LoRA weights or the learned embedding for those methods), the summary
(losses, speed, memory, weight hashes) to --report and the loss curve to --plot. Checkpoints go
to `train.checkpoints_dir` (outside the DVC outputs); SIGTERM/SIGINT save one and exit 128+signal.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from tasks.common.config import load_config, read_params
from tasks.common.confine import confine
from tasks.common.distributed import failures_named, join
from tasks.common.errors import main_guard
from tasks.common.launch import start
from tasks.train.config import TrainConfig


@main_guard
def main() -> None:
    confine("train")  # only the credentials this stage uses, before any work
    parser = argparse.ArgumentParser(prog="python -m tasks.train", description=__doc__.split("\n\n")[1])
    parser.add_argument("--base", type=Path, required=True, help="base pipeline folder (stage `base`)")
    parser.add_argument("--data", type=Path, required=True, help="instance imagefolder (stage `ingest`)")
    parser.add_argument("--class-data", type=Path, required=True, help="class imagefolder (stage `class_images`)")
    parser.add_argument("--out", type=Path, required=True, help="output folder to write")
    parser.add_argument("--report", type=Path, required=True, help="JSON summary (DVC metrics)")
    parser.add_argument("--plot", type=Path, required=True, help="CSV step,loss,lr (DVC plot)")
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    args = parser.parse_args()
    cfg = load_config("train", TrainConfig, args.params)
    # checkpoint_scoring's null keys follow register.primary_metric(_goal) and evaluate's encoders
    cfg = cfg.with_scoring_from(read_params(args.params))
    start("train", cfg.launcher, cfg.launch)  # under mpirun/accelerate: re-executes there and exits
    from tasks.train.stage import train_and_record  # torch, diffusers, MLflow: only where it trains

    worker = join()  # this process's rank (0 of 1 when local)
    with failures_named(worker):
        train_and_record(args, cfg, worker.is_main)


if __name__ == "__main__":
    main()
