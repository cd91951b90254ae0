"""python -m tasks.ingest --out data/processed --report reports/ingest.json
    --rejected reports/ingest_rejected.jsonl [--params params.yaml]

Reads every source in `ingest.sources`, keeps the valid images normalised into an imagefolder at
--out, and writes the counts (--report) and one line per dropped input (--rejected).
"""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

from tasks.common.concepts import metric_key
from tasks.common.config import load_config, read_params
from tasks.common.confine import confine
from tasks.common.errors import main_guard
from tasks.common.images import make_grid
from tasks.common.outputs import atomic_dir, atomic_file, write_json
from tasks.common.tracking import stage_run
from tasks.ingest.config import IngestConfig
from tasks.ingest.core import CLIPS_METADATA, METADATA, check_sources, ingest, require_kept
from tasks.ingest.deps import check_dvc_deps

log = logging.getLogger("tasks.ingest")


@main_guard
def main() -> None:
    confine("ingest")  # only the credentials this stage uses, before any work
    about = __doc__.split("\n\n")[1]
    parser = argparse.ArgumentParser(prog="python -m tasks.ingest", description=about)
    arg = parser.add_argument
    arg("--out", type=Path, required=True, help="imagefolder to write (images + metadata.jsonl)")
    arg("--report", type=Path, required=True, help="JSON counts (DVC metrics)")
    arg("--rejected", type=Path, required=True, help="JSON lines: one per rejected input")
    arg("--params", type=Path, default=Path("params.yaml"))
    args = parser.parse_args()
    cfg = load_config("ingest", IngestConfig, args.params)
    # Fail fast, before an MLflow run is opened: missing folders, dvc.yaml missing a source.
    check_sources(cfg)
    check_dvc_deps(cfg, read_params(args.params))
    with stage_run("ingest", params=cfg.model_dump(mode="json")) as run:
        with atomic_dir(args.out) as tmp:
            # Written even when nothing is kept: it is how the user finds out why.
            with atomic_file(args.rejected) as rejected:
                summary = ingest(cfg, tmp, rejected)
            require_kept(summary, args.rejected)
        report = summary.report()
        write_json(args.report, report)
        run.log_metrics(
            {
                **{k: v for k, v in report.items() if isinstance(v, int)},
                **{f"rejected.{k}": v for k, v in report["rejected_by_reason"].items()},
                **{f"masks.{k}": v for k, v in report["masks_by_source"].items()},
                **{f"captions.{k}": v for k, v in report["captions_by_source"].items()},
                "cache_hits": summary.cache_hits,
                **{f"concept.{metric_key(k)}.images": v for k, v in report.get("by_concept", {}).items()},
                **{f"clips.{k}": report["clips"][k] for k in ("inputs", "kept") if "clips" in report},
            }
        )
        run.log_image(make_grid(summary.samples), "ingest_samples.png")
        run.log_artifact(args.report)
        run.log_artifact(args.rejected)
        run.log_artifact(args.out / METADATA)
        if (args.out / CLIPS_METADATA).exists():
            run.log_artifact(args.out / CLIPS_METADATA)
    log.info(
        "kept %d of %d inputs into %s (rejected %d: see %s; %d from the cache)",
        report["kept"], report["total"], args.out, report["rejected"], args.rejected,
        summary.cache_hits,
    )


if __name__ == "__main__":
    main()
