"""The train stage's body: train, write the outputs and log the run to MLflow (rank 0).

`python -m tasks.train` imports it only after the launcher's `start()`, so that the process a
launcher replaces or waits on (mpirun, accelerate, the allocator's re-execution) never loads torch,
diffusers or MLflow.
"""
from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tasks.common.allocator import say_allocator
from tasks.common.concepts import metric_key
from tasks.common.images import make_grid
from tasks.common.outputs import write_json
from tasks.common.scoring import IMAGE_METRICS
from tasks.common.tracking import stage_run
from tasks.train.config import TrainConfig
from tasks.train.core import train, write_loss_csv
from tasks.train.interrupts import TrainingInterrupted
from tasks.train.steplog import StepLog

log = logging.getLogger("tasks.train")


def _slug(prompt: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in prompt)[:60].strip("_") or "prompt"


def _enable_system_metrics(interval: float) -> None:
    """MLflow's CPU/memory/disk/network (and GPU with pynvml) sampling for the stage's run."""
    if interval <= 0:
        return
    import mlflow

    mlflow.enable_system_metrics_logging()
    mlflow.set_system_metrics_sampling_interval(interval)


class _NoRun:
    """What ranks other than 0 log to: nothing."""

    def __getattr__(self, name: str):  # log_metrics, log_image, set_tags, ...
        return lambda *args, **kwargs: None


@contextmanager
def _no_run() -> Iterator[_NoRun]:
    yield _NoRun()


def train_and_record(args: argparse.Namespace, cfg: TrainConfig, main_process: bool) -> None:
    """Train; under a launcher only rank 0 writes the outputs and logs to MLflow."""
    logging.getLogger("accelerate").setLevel(logging.WARNING)  # it logs every file of every checkpoint
    allocator = say_allocator("train")  # a warning, with the cost and the fix, on glibc's defaults
    if main_process:
        _enable_system_metrics(cfg.system_metrics_interval)
    try:
        with stage_run("train", params=cfg.model_dump(mode="json")) if main_process else _no_run() as run:
            run.set_tags({"train.allocator": allocator})

            def log_step(entry: StepLog) -> None:
                if entry.step % cfg.log_every_steps == 0 or entry.step == cfg.max_train_steps:
                    run.log_metrics(entry.metrics(), step=entry.step)
                for prompt, images in (entry.validation or {}).items():
                    run.log_image(make_grid(images), f"validation/step_{entry.step:06d}_{_slug(prompt)}.png")
                if entry.checkpoint is not None:
                    run.set_tags({"train.last_checkpoint": str(entry.checkpoint)})

            try:
                outcome = train(cfg, args.base, args.data, args.class_data, args.out, callbacks=[log_step])
            except TrainingInterrupted as err:
                run.set_tags({"train.interrupted": str(err)})
                raise
            if not main_process:
                return
            report = _record(run, args, outcome, allocator)
    except TrainingInterrupted as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(128 + err.signum)
    log.info("%s: %d steps in %.1f s (final loss %.4f); output written to %s",
             outcome.method, report["steps"], report["seconds"], report["final_loss"], args.out)


def _record(run: Any, args: argparse.Namespace, outcome: Any, allocator: str) -> dict[str, Any]:
    """Rank 0, after training: the loss CSV, the report, and the run's tags, metrics and artifacts."""
    write_loss_csv(args.plot, outcome.losses)
    report = {**outcome.report(), "allocator": allocator}
    write_json(args.report, report)
    run.set_tags({"train.method": outcome.method, "train.family": outcome.family,
                  "train.checkpoint_dir": str(outcome.checkpoint_dir),
                  "train.selected_step": str(report["selected_checkpoint"]["step"]),
                  **{f"train.{k}": report[k] for k in ("mixed_precision", "precision_why") if k in report}})
    for record in report["checkpoints"]:
        run.log_metrics({f"checkpoint_{k}": record[k] for k in IMAGE_METRICS}, step=record["step"])
    run.log_metrics({
        "final_loss": report["final_loss"],
        "train_seconds": report["seconds"],
        "total_seconds": report["total_seconds"],
        "latent_cache_seconds": report["latent_cache_seconds"],
        "text_cache_seconds": report["text_cache_seconds"],
        "median_step_seconds": report["median_step_seconds"],
        "train_images_per_second": report["images_per_second"],
        "peak_memory_mb": report["peak_memory_mb"],
        **{f"peak_rss_mb.{phase}": mb for phase, mb in report["peak_rss_mb_by_phase"].items()},
    })
    if report.get("concepts"):  # images, repeats, examples per epoch and seen, per concept
        run.log_metrics({f"concept.{metric_key(name)}.{k}": v for name, counts in report["concepts"].items()
                         for k, v in counts.items()})
    run.log_dict(report["weights_sha256"], "weights_sha256.json")
    run.log_artifact(args.report)
    run.log_artifact(args.plot)
    for prompt, images in outcome.validation.items():
        run.log_image(make_grid(images), f"validation/final_{_slug(prompt)}.png")
    if outcome.validation:
        run.log_image(make_grid([im for ims in outcome.validation.values() for im in ims]), "validation_grid.png")
    return report
