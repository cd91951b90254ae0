"""python -m tasks.export --model models/finetuned --base models/base --out models/openvino
--report reports/export.json

Converts the train stage's output to OpenVINO at the static shape in params.yaml (`export`):
a full pipeline directly, LoRA weights / textual-inversion embeddings applied to `--base` first.
Checks parity against PyTorch, optionally compresses the weights with NNCF, times PyTorch eager
and OpenVINO dynamic / static / compressed, and writes the folder only when the gates hold.
"""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

from tasks.common.config import load_config
from tasks.common.confine import confine
from tasks.common.errors import UserError, main_guard
from tasks.common.openvino_model import SKIPPED_FILE, write_skipped
from tasks.common.outputs import atomic_dir, write_json
from tasks.common.tracking import stage_run
from tasks.export.components import export_components
from tasks.export.config import ExportConfig
from tasks.export.core import export, numeric_metrics
from tasks.export.runtime import export_runtime

log = logging.getLogger("tasks.export")


def skip(out: Path, report_path: Path, cfg: ExportConfig) -> None:
    """export.enabled: false: the folder holds only the note, the report says why; nothing loads."""
    reason = "export.enabled: false"
    with stage_run("export", params=cfg.model_dump()) as run, atomic_dir(out) as tmp:
        write_skipped(tmp, reason)
        report = {"skipped": True, "reason": reason, "output": str(out)}
        write_json(report_path, report)
        run.log_dict(report, "export.json")
        run.set_tags({"export.skipped": "true"})
    log.warning("no OpenVINO export (%s): %s holds only %s; evaluate scores the PyTorch fine-tune alone",
                reason, out, SKIPPED_FILE)


@main_guard
def main() -> None:
    confine("export")  # only the credentials this stage uses, before any work
    parser = argparse.ArgumentParser(prog="python -m tasks.export", description=__doc__)
    parser.add_argument("--model", type=Path, required=True, help="diffusers pipeline to export")
    parser.add_argument(
        "--base", type=Path, default=None,
        help="base pipeline the adapters apply to (needed when --model holds only LoRA/TI files)",
    )
    parser.add_argument("--out", type=Path, required=True, help="OpenVINO pipeline folder to write")
    parser.add_argument("--report", type=Path, required=True, help="JSON report (DVC metrics)")
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    args = parser.parse_args()
    cfg = load_config("export", ExportConfig, args.params)
    if not cfg.enabled:
        skip(args.out, args.report, cfg)
        return
    with stage_run("export", params=cfg.model_dump()) as run, atomic_dir(args.out) as tmp:
        if cfg.adapters == "runtime":
            report = export_runtime(args.model, tmp, cfg, base=args.base)
        elif cfg.components == "one_at_a_time":
            report = export_components(args.model, tmp, cfg, base=args.base)
        else:
            report = export(args.model, tmp, cfg, base=args.base)
        report["output"] = str(args.out)
        write_json(args.report, report)
        run.log_metrics(numeric_metrics(report))
        run.log_dict(report, "export.json")
        parity = report["parity"]
        run.set_tags(
            {"export.family": report["family"], "export.parity_passed": parity["passed"],
             "export.source_kind": report["source_kind"]["method"],
             "export.compression": cfg.compression.mode, "export.adapters": cfg.adapters,
             "export.inference_precision": cfg.inference_precision, "export.components": cfg.components}
        )
        if parity.get("failed_components"):
            raise UserError(
                f"parity check failed for {', '.join(parity['failed_components'])}: the converted model's "
                f"outputs differ from its PyTorch source's by more than export.parity.component_max_rel "
                f"{parity['component_max_rel']} (see parity.components in {args.report}). The export is not "
                "written. A broken conversion must not reach the registry; raise the threshold only for a "
                "16-bit source whose error is rounding"
            )
        if not parity["passed"]:
            raise UserError(
                f"parity check failed: OpenVINO and PyTorch images differ (PSNR "
                f"{parity.get('image_psnr_db')} dB < export.parity.min_psnr_db "
                f"{parity.get('min_psnr_db')}; finite outputs: {parity.get('finite')}). The "
                f"export is not written; see {args.report}. A broken export must not reach the "
                "registry"
            )
        comp = report.get("compression", {})
        if comp.get("passed") is False:
            raise UserError(
                f"compressed ({comp['mode']}) images differ too much from fp32: PSNR "
                f"{comp.get('psnr_vs_openvino_fp32_db')} dB < export.compression.min_psnr_db "
                f"{comp.get('min_psnr_db')} (finite: {comp.get('finite')}). Use a milder mode "
                "(int8, or int4 with a lower ratio) or lower the threshold"
            )
    log.info(
        "OpenVINO pipeline written to %s (static shape %s); report %s",
        args.out, report["static_shape"], args.report,
    )


if __name__ == "__main__":
    main()
