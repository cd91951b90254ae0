"""python -m tasks.class_images --base models/base --out data/class_images
    --report reports/class_images.json [--params params.yaml]

Generates `class_images.num_images` images of `class_images.prompt` with the base model into an
imagefolder at --out (images + metadata.jsonl), reusing images already there, and writes counts
and timing to --report.
"""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

from PIL import Image

from tasks.class_images.config import ClassImagesConfig
from tasks.class_images.core import METADATA, Summary, image_name, run
from tasks.common.config import load_config
from tasks.common.distributed import failures_named, join
from tasks.common.errors import main_guard
from tasks.common.images import make_grid
from tasks.common.launch import start
from tasks.common.outputs import write_json
from tasks.common.tracking import stage_run

log = logging.getLogger("tasks.class_images")
GRID_IMAGES = 16


@main_guard
def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tasks.class_images", description=__doc__.split("\n\n")[1])
    parser.add_argument("--base", type=Path, required=True, help="base pipeline folder (stage `base`)")
    parser.add_argument("--out", type=Path, required=True, help="imagefolder to fill (kept between runs)")
    parser.add_argument("--report", type=Path, required=True, help="JSON counts and timing (DVC metrics)")
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    args = parser.parse_args()
    cfg = load_config("class_images", ClassImagesConfig, args.params)
    start("class_images", cfg.launcher, cfg.launch)  # under mpirun/accelerate: re-executes there and exits
    worker = join()
    with failures_named(worker):
        if worker.world_size == 1:
            _record(args, cfg, None)
        else:  # every rank generates its share; rank 0 then reports
            from accelerate import PartialState

            state = PartialState()
            summary = run(cfg, args.base, args.out, rank=worker.rank, world_size=worker.world_size,
                          barrier=state.wait_for_everyone, device=state.device)
            if worker.is_main:
                _record(args, cfg, summary)


def _record(args: argparse.Namespace, cfg: ClassImagesConfig, done: Summary | None) -> None:
    """Generate (unless `done` by the ranks already), then write the report and log to MLflow."""
    with stage_run("class_images", params=cfg.model_dump(mode="json")) as run_:
        summary = done if done is not None else run(cfg, args.base, args.out)
        report = summary.report()
        write_json(args.report, report)
        run_.set_tags({"class_images.base_fingerprint": summary.base_fingerprint})
        metrics = {k: v for k, v in report.items() if isinstance(v, (int, float))}
        if summary.generated:
            metrics["images_per_second"] = summary.generated / max(summary.seconds, 1e-9)
        run_.log_metrics(metrics)
        shown = [Image.open(args.out / image_name(i)) for i in range(min(cfg.num_images, GRID_IMAGES))]
        if shown:
            run_.log_image(make_grid(shown), "class_images_grid.png")
        run_.log_artifact(args.report)
        run_.log_artifact(args.out / METADATA)
    log.info(
        "%d class images in %s (%d generated, %d reused, %d files removed) in %.1f s",
        cfg.num_images, args.out, summary.generated, summary.reused, summary.removed, summary.seconds,
    )

if __name__ == "__main__":
    main()
