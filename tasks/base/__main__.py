"""python -m tasks.base --out models/base [--params params.yaml]"""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

from tasks.base.config import BaseConfig
from tasks.base.core import resolve
from tasks.common.config import load_config
from tasks.common.confine import confine
from tasks.common.errors import main_guard
from tasks.common.outputs import atomic_dir
from tasks.common.tracking import stage_run

log = logging.getLogger("tasks.base")


@main_guard
def main() -> None:
    confine("base")  # only the credentials this stage uses, before any work
    parser = argparse.ArgumentParser(prog="python -m tasks.base", description=__doc__)
    parser.add_argument("--out", type=Path, required=True, help="pipeline folder to write")
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    args = parser.parse_args()
    cfg = load_config("base", BaseConfig, args.params)
    with stage_run("base", params=cfg.model_dump()) as run:
        with atomic_dir(args.out) as tmp:
            info = resolve(cfg.model, cfg.revision, cfg.seed, tmp)
        run.set_tags({f"base.{k}": v for k, v in info.items() if v is not None})
        run.log_dict(info, "base.json")
    log.info("base model (%s, %s) written to %s", info["model"], info["family"], args.out)


if __name__ == "__main__":
    main()
