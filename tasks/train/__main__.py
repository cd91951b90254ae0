"""python -m tasks.train --base models/base --data data/processed --class-data data/class_images
    --out models/finetuned --report reports/train.json --plot reports/train_loss.csv [--params params.yaml]

Fine-tunes the base model with `train.method` and writes a full diffusers pipeline folder to
--out, the summary (final loss, speed, weight hashes) to --report and the loss curve to --plot.
"""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

from tasks.common.config import load_config
from tasks.common.errors import main_guard
from tasks.common.images import make_grid
from tasks.common.outputs import write_json
from tasks.common.tracking import stage_run
from tasks.train.config import TrainConfig
from tasks.train.core import train, write_loss_csv
from tasks.train.loop import StepLog

log = logging.getLogger("tasks.train")


@main_guard
def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tasks.train", description=__doc__.split("\n\n")[1])
    parser.add_argument("--base", type=Path, required=True, help="base pipeline folder (stage `base`)")
    parser.add_argument("--data", type=Path, required=True, help="instance imagefolder (stage `ingest`)")
    parser.add_argument("--class-data", type=Path, required=True, help="class imagefolder (stage `class_images`)")
    parser.add_argument("--out", type=Path, required=True, help="pipeline folder to write")
    parser.add_argument("--report", type=Path, required=True, help="JSON summary (DVC metrics)")
    parser.add_argument("--plot", type=Path, required=True, help="CSV step,loss,lr (DVC plot)")
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    args = parser.parse_args()
    cfg = load_config("train", TrainConfig, args.params)
    with stage_run("train", params=cfg.model_dump(mode="json")) as run:

        def log_step(entry: StepLog) -> None:
            if entry.step % cfg.log_every_steps == 0 or entry.step == cfg.max_train_steps:
                run.log_metrics(entry.metrics(), step=entry.step)

        outcome = train(cfg, args.base, args.data, args.class_data, args.out, callbacks=[log_step])
        write_loss_csv(args.plot, outcome.history)
        report = outcome.report()
        write_json(args.report, report)
        run.set_tags({"train.method": outcome.method, "train.family": outcome.family})
        run.log_metrics({
            "final_loss": report["final_loss"],
            "train_seconds": report["seconds"],
            "total_seconds": report["total_seconds"],
            "median_step_seconds": report["median_step_seconds"],
            "train_images_per_second": report["images_per_second"],
        })
        run.log_artifact(args.report)
        run.log_artifact(args.plot)
        if outcome.validation:
            run.log_image(make_grid(outcome.validation), "validation_grid.png")
    log.info("%s: %d steps in %.1f s (final loss %.4f); pipeline written to %s",
             outcome.method, report["steps"], report["seconds"], report["final_loss"], args.out)


if __name__ == "__main__":
    main()
