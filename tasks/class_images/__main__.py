"""python -m tasks.class_images --base models/base --out data/class_images
    --report reports/class_images.json [--params params.yaml]

Generates `class_images.num_images` images of `class_images.prompt` with the base model into an
imagefolder at --out (images + metadata.jsonl), reusing images already there, and writes counts
and timing to --report.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from tasks.class_images.config import ClassImagesConfig
from tasks.common.config import load_config, read_params
from tasks.common.confine import confine
from tasks.common.distributed import failures_named, join
from tasks.common.errors import main_guard
from tasks.common.launch import start
from tasks.common.quantize import following_train


@main_guard
def main() -> None:
    confine("class_images")  # only the credentials this stage uses, before any work
    parser = argparse.ArgumentParser(prog="python -m tasks.class_images", description=__doc__.split("\n\n")[1])
    parser.add_argument("--base", type=Path, required=True, help="base pipeline folder (stage `base`)")
    parser.add_argument("--out", type=Path, required=True, help="imagefolder to fill (kept between runs)")
    parser.add_argument("--report", type=Path, required=True, help="JSON counts and timing (DVC metrics)")
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    args = parser.parse_args()
    cfg = following_train("class_images", load_config("class_images", ClassImagesConfig, args.params),
                          read_params(args.params))
    start("class_images", cfg.launcher, cfg.launch)  # under mpirun/accelerate: re-executes there and exits
    from tasks.class_images.stage import generate_and_record  # torch, diffusers, MLflow: only where it runs

    worker = join()
    with failures_named(worker):
        generate_and_record(args, cfg, worker)


if __name__ == "__main__":
    main()
