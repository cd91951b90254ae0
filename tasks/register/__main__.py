"""python -m tasks.register --finetuned models/finetuned --openvino models/openvino
--evaluation reports/evaluate.json [--train-report reports/train.json] [--base models/base]
[--grids reports/evaluate] [--loss reports/train_loss.csv] [--lock dvc.lock] [--params params.yaml]
[--run-id ID]"""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

from tasks.common.errors import main_guard
from tasks.common.tracking import configure, tracking_uri
from tasks.register.core import register

log = logging.getLogger("tasks.register")


@main_guard
def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tasks.register", description=__doc__)
    parser.add_argument("--finetuned", type=Path, required=True, help="diffusers pipeline folder")
    parser.add_argument("--openvino", type=Path, required=True, help="OpenVINO export folder")
    parser.add_argument("--evaluation", type=Path, required=True, help="evaluate's report")
    parser.add_argument("--base", type=Path, default=None,
                        help="base pipeline folder: needed when --finetuned holds LoRA adapters "
                             "only (train.fuse_lora: false)")
    parser.add_argument("--train-report", type=Path, default=Path("reports/train.json"),
                        help="the train stage's report: what the version says it trained (tags train.*)")
    parser.add_argument("--grids", type=Path, default=Path("reports/evaluate"),
                        help="the evaluate stage's plots folder: its grids go into the version's run")
    parser.add_argument("--loss", type=Path, default=Path("reports/train_loss.csv"),
                        help="the train stage's loss table: drawn as the version's run's loss curve")
    parser.add_argument("--lock", type=Path, default=Path("dvc.lock"), help="lineage source")
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    parser.add_argument("--run-id", default=None, help="log into this MLflow run, not a new one")
    args = parser.parse_args()
    configure()
    result = register(
        args.finetuned, args.openvino, args.evaluation, args.lock, args.params, args.run_id,
        base=args.base, train_report=args.train_report, grids=args.grids, loss_table=args.loss,
    )
    log.info(
        "registered %s version %s (aliases: %s) in %s; load it with "
        "mlflow.pyfunc.load_model('models:/%s@candidate')",
        result.name, result.version, ", ".join(result.aliases), tracking_uri(), result.name,
    )


if __name__ == "__main__":
    main()
