"""python -m tasks.class_images --base models/base --out data/class_images
    --report reports/class_images.json [--params params.yaml]

Generates `class_images.num_images` images of `class_images.prompt` with the base model into an
imagefolder at --out (images + metadata.jsonl), reusing images already there, and writes counts
and timing to --report. With `train.with_prior_preservation: false` nothing trains on them: it
makes none, loads nothing and leaves --out as it is (created empty where missing).
"""
from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from tasks.class_images.config import ClassImagesConfig
from tasks.common.config import load_config, read_params
from tasks.common.confine import confine
from tasks.common.distributed import failures_named, join
from tasks.common.edit_data import prior_preservation_problem
from tasks.common.errors import UserError, main_guard
from tasks.common.launch import start
from tasks.common.quantize import following_train

log = logging.getLogger("tasks.class_images")
NOT_NEEDED = "train.with_prior_preservation: false"


def needed(params: dict[str, Any]) -> bool:
    """Whether the train stage reads class images: prior preservation on (its default: true)."""
    return (params.get("train") or {}).get("with_prior_preservation", True) is not False


def skip(args: argparse.Namespace, cfg: ClassImagesConfig) -> None:
    """No class images are needed: none made, the folder left as it is (a later run with prior
    preservation on reuses what it holds), the report says why; no model loads."""
    from tasks.common.outputs import write_json
    from tasks.common.tracking import stage_run

    kept = sum(1 for p in args.out.rglob("*.png")) if args.out.is_dir() else 0
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"skipped": True, "reason": NOT_NEEDED, "num_images": 0, "generated": 0, "kept_unused": kept}
    with stage_run("class_images", params=cfg.model_dump(mode="json")) as run:
        write_json(args.report, report)
        run.log_dict(report, "class_images.json")
        run.set_tags({"class_images.skipped": "true"})
    log.info("no class images (%s: the train stage reads none)%s", NOT_NEEDED,
             f"; the {kept} in {args.out} are kept, unused" if kept else "")


@main_guard
def main() -> None:
    confine("class_images")  # only the credentials this stage uses, before any work
    parser = argparse.ArgumentParser(prog="python -m tasks.class_images", description=__doc__.split("\n\n")[1])
    parser.add_argument("--base", type=Path, required=True, help="base pipeline folder (stage `base`)")
    parser.add_argument("--out", type=Path, required=True, help="imagefolder to fill (kept between runs)")
    parser.add_argument("--report", type=Path, required=True, help="JSON counts and timing (DVC metrics)")
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    args = parser.parse_args()
    params = read_params(args.params)
    cfg = following_train("class_images", load_config("class_images", ClassImagesConfig, args.params), params)
    if not needed(params):
        skip(args, cfg)
        return
    if problem := prior_preservation_problem(params.get("ingest") or {}, True):  # before any image is made
        raise UserError(f"{args.params}: {problem}")
    start("class_images", cfg.launcher, cfg.launch)  # under mpirun/accelerate: re-executes there and exits
    from tasks.class_images.stage import generate_and_record  # torch, diffusers, MLflow: only where it runs

    worker = join()
    with failures_named(worker):
        generate_and_record(args, cfg, worker)


if __name__ == "__main__":
    main()
