"""python -m tasks.ingest --out data/processed --report reports/ingest.json
    --rejected reports/ingest_rejected.jsonl [--params params.yaml]

Reads the instance images named by `ingest.source`, keeps the valid ones normalised into an
imagefolder at --out, and writes the counts (--report) and one line per dropped file (--rejected).
"""
from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from tasks.common.config import load_config
from tasks.common.errors import main_guard
from tasks.common.images import make_grid
from tasks.common.outputs import atomic_dir, atomic_file, write_json
from tasks.common.tracking import stage_run
from tasks.ingest.config import IngestConfig
from tasks.ingest.core import METADATA, ingest, require_kept, source_root

log = logging.getLogger("tasks.ingest")


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with atomic_file(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as fh:
            for row in rows:
                fh.write(json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n")


@main_guard
def main() -> None:
    about = __doc__.split("\n\n")[1]
    parser = argparse.ArgumentParser(prog="python -m tasks.ingest", description=about)
    arg = parser.add_argument
    arg("--out", type=Path, required=True, help="imagefolder to write (images + metadata.jsonl)")
    arg("--report", type=Path, required=True, help="JSON counts (DVC metrics)")
    arg("--rejected", type=Path, required=True, help="JSON lines: one per rejected file")
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    args = parser.parse_args()
    cfg = load_config("ingest", IngestConfig, args.params)
    source_root(cfg.source)  # fail fast, before an MLflow run is opened, if there is no source
    with stage_run("ingest", params=cfg.model_dump(mode="json")) as run:
        with atomic_dir(args.out) as tmp:
            summary = ingest(cfg, tmp)
            # Written even when nothing was kept: it is how the user finds out why.
            write_jsonl(args.rejected, summary.rejected)
            require_kept(summary, cfg.source, args.rejected)
        report = summary.report()
        write_json(args.report, report)
        run.log_metrics(
            {
                **{k: v for k, v in report.items() if isinstance(v, int)},
                **{f"rejected.{k}": v for k, v in report["rejected_by_reason"].items()},
            }
        )
        run.log_image(make_grid(summary.samples), "ingest_samples.png")
        run.log_artifact(args.report)
        run.log_artifact(args.rejected)
        run.log_artifact(args.out / METADATA)
    log.info(
        "kept %d of %d files into %s (rejected %d: see %s)",
        report["kept"], report["total"], args.out, report["rejected"], args.rejected,
    )


if __name__ == "__main__":
    main()
