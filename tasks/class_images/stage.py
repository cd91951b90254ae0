"""The class_images stage's body: generate (each rank its share), write the report and log the run
to MLflow (rank 0).

`python -m tasks.class_images` imports it only after the launcher's `start()`, so that the process a
launcher replaces or waits on never loads torch, diffusers or MLflow.
"""
from __future__ import annotations

import argparse
import logging

from accelerate import PartialState
from PIL import Image

from tasks.class_images.concepts import image_paths, metadata_files, run_all
from tasks.class_images.config import ClassImagesConfig
from tasks.class_images.core import Summary
from tasks.common.allocator import say_allocator
from tasks.common.concepts import metric_key
from tasks.common.distributed import Worker
from tasks.common.images import make_grid
from tasks.common.outputs import write_json
from tasks.common.tracking import stage_run

log = logging.getLogger("tasks.class_images")
GRID_IMAGES = 16


def generate_and_record(args: argparse.Namespace, cfg: ClassImagesConfig, worker: Worker) -> None:
    """Generate on this rank; rank 0 (the only one when local) then reports."""
    if worker.world_size == 1:
        _record(args, cfg, None)
        return
    state = PartialState()  # every rank generates its share; rank 0 then reports
    summary = run_all(cfg, args.base, args.out, rank=worker.rank, world_size=worker.world_size,
                      barrier=state.wait_for_everyone, device=state.device)
    if worker.is_main:
        _record(args, cfg, summary)


def _record(args: argparse.Namespace, cfg: ClassImagesConfig, done: Summary | None) -> None:
    """Generate (unless `done` by the ranks already), then write the report and log to MLflow."""
    with stage_run("class_images", params=cfg.model_dump(mode="json")) as run_:
        summary = done if done is not None else run_all(cfg, args.base, args.out)
        report = summary.report()
        write_json(args.report, report)
        run_.set_tags({"class_images.base_fingerprint": summary.base_fingerprint,
                       "class_images.allocator": say_allocator("class_images")})
        metrics = {k: v for k, v in report.items() if isinstance(v, (int, float))}
        metrics |= {f"concept.{metric_key(name)}.{k}": v for name, counts in report.get("concepts", {}).items()
                    for k, v in counts.items()}
        if summary.generated:
            metrics["images_per_second"] = summary.generated / max(summary.seconds, 1e-9)
        run_.log_metrics(metrics)
        shown = [Image.open(path) for path in image_paths(cfg, args.out, GRID_IMAGES)]
        if shown:
            run_.log_image(make_grid(shown), "class_images_grid.png")
        run_.log_artifact(args.report)
        for path in metadata_files(cfg, args.out):
            run_.log_artifact(path, f"concepts/{metric_key(path.parent.name)}" if cfg.concepts else None)
    log.info(
        "%d class images in %s (%d generated, %d reused, %d files removed) in %.1f s",
        summary.num_images, args.out, summary.generated, summary.reused, summary.removed, summary.seconds,
    )
