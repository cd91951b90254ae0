"""python -m tasks.evaluate --model models/finetuned --export models/openvino --base models/base
--instance-data data/processed --out reports/evaluate --report reports/evaluate.json
[--metrics reports/evaluate_metrics.json] [--heldout-data data/heldout]

Generates the prompt list (the DreamBooth paper's object / live set, or custom) with the
fine-tune (--model: a pipeline, or adapters applied to --base) and, on the same seeds and
latents, the base model, both in PyTorch fp32 (or both on the denoiser quantized as the train stage
held it: evaluate.base_model_precision), so the gains compare like with like; scores
CLIP-T, CLIP-I and DINO, language drift on class prompts and, for full fine-tunes, held-out
CLIP-T and a Fréchet distance. Apart from the gains, the OpenVINO export (--export) makes the
same images and is compared with the PyTorch fine-tune (export fidelity: PSNR, metric deltas).
Applies the gate in params.yaml (`evaluate.gate`), and writes the report (DVC metrics), an
optional flat metrics file, and a plots folder: grid.png, grid_base.png, grid_export.png,
per_prompt.csv. When --instance-data is an edit dataset (targets with reference images), both models
also edit its first `evaluate.edits.max_pairs` triples, scored against the targets (edit_* metrics;
grid_edits.png, per_edit.csv). A video model trained as image-to-video (train.first_frame_conditioning_p > 0)
also continues the subject clips from their first frames with both models (i2v_* metrics; grid_i2v.png,
grid_i2v_base.png, preview_i2v.gif, per_i2v.csv). One pipeline is in memory at a time and the encoders load after the
last; each phase's peak RSS is in the report (`memory`) and on the MLflow run; the base's images come
from `evaluate.base_cache_dir` when a fine-tune of the same base was evaluated under the same protocol
(tasks/evaluate/README.md).
"""
from __future__ import annotations

import argparse
import csv
import logging
from pathlib import Path

from tasks.common.config import load_config, read_params
from tasks.common.confine import confine
from tasks.common.errors import main_guard
from tasks.common.images import make_grid
from tasks.common.openvino_model import export_or_none
from tasks.common.outputs import atomic_dir, check_replaceable, write_json
from tasks.common.quantize import following_train
from tasks.common.scoring import split_frames
from tasks.common.tracking import stage_run
from tasks.evaluate.config import EvaluateConfig, following_train_i2v
from tasks.evaluate.core import Result, evaluate

log = logging.getLogger("tasks.evaluate")
#: preview.gif's frame time (8 fps: ingest.video.fps's default, what the demo clips train at)
PREVIEW_MS_PER_FRAME = 125


def write_plots(result: Result, out: Path, images_per_prompt: int) -> dict[str, Path]:
    """grid.png (one row per prompt), grid_base.png, per_prompt.csv (and for an edit set
    grid_edits.png, per_edit.csv; for a video model preview.gif, the fine-tune's first clip; for one trained
    as image-to-video grid_i2v.png, grid_i2v_base.png, preview_i2v.gif, per_i2v.csv) into `out`."""
    paths = {"grid": out / "grid.png", "csv": out / "per_prompt.csv"}
    flat = [im for row in result.images for im in row]
    make_grid(flat, cols=images_per_prompt).save(paths["grid"])
    if result.base_images is not None:
        paths["grid_base"] = out / "grid_base.png"
        make_grid([im for row in result.base_images for im in row], cols=images_per_prompt).save(
            paths["grid_base"]
        )
    export = result.extra.get("export_images")
    if export:
        paths["grid_export"] = out / "grid_export.png"
        make_grid([im for row in export for im in row], cols=images_per_prompt).save(
            paths["grid_export"]
        )
    _write_csv(paths["csv"], result.rows)
    if (frames := result.extra.get("frames", 1)) > 1:  # a video model: its images are filmstrips
        paths["preview"] = out / "preview.gif"
        first, *rest = split_frames(result.images[0][0], frames)
        first.save(paths["preview"], save_all=True, append_images=rest, duration=PREVIEW_MS_PER_FRAME, loop=0)
    if result.extra.get("i2v"):
        paths.update(_write_i2v(result.extra["i2v"], out, images_per_prompt, frames))
    edit_grid = result.extra.get("edit_grid")
    if edit_grid:  # an edit dataset: a row per triple (references, target, fine-tune's, base's edit)
        paths["grid_edits"], paths["edits_csv"] = out / "grid_edits.png", out / "per_edit.csv"
        make_grid(edit_grid[0], cols=edit_grid[1]).save(paths["grid_edits"])
        _write_csv(paths["edits_csv"], result.edit_rows)
    return paths


def _write_i2v(i2v: dict, out: Path, images_per_prompt: int, frames: int) -> dict[str, Path]:
    """The image-to-video clips: grid_i2v.png (one row per subject clip continued), grid_i2v_base.png,
    preview_i2v.gif (the fine-tune's first), per_i2v.csv."""
    paths = {"grid_i2v": out / "grid_i2v.png", "i2v_csv": out / "per_i2v.csv", "preview_i2v": out / "preview_i2v.gif"}
    make_grid([im for row in i2v["images"] for im in row], cols=images_per_prompt).save(paths["grid_i2v"])
    if i2v["base_images"] is not None:
        paths["grid_i2v_base"] = out / "grid_i2v_base.png"
        make_grid([im for row in i2v["base_images"] for im in row], cols=images_per_prompt).save(paths["grid_i2v_base"])
    first, *rest = split_frames(i2v["images"][0][0], frames)
    first.save(paths["preview_i2v"], save_all=True, append_images=rest, duration=PREVIEW_MS_PER_FRAME, loop=0)
    _write_csv(paths["i2v_csv"], i2v["rows"])
    return paths


def _write_csv(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def flat_metrics(report: dict) -> dict[str, float]:
    """{metric: value}, export_fidelity.<figure>, gate.passed (1/0) and gate.<check>.passed;
    nulls left out.

    Flat and numeric only, so `dvc metrics diff` on it reads as one line per figure (the full
    report keeps prompts, encoders and the paper's table beside them).
    """
    flat = {k: v for k, v in report["metrics"].items() if v is not None}
    flat.update(fidelity_metrics(report))
    flat["gate.passed"] = int(report["gate"]["passed"])
    for name, check in report["gate"]["checks"].items():
        flat[f"gate.{name}.passed"] = int(check["passed"])
    return flat


def fidelity_metrics(report: dict) -> dict[str, float]:
    """The export fidelity figures as export_fidelity.<name> (none when it was not measured)."""
    section = report.get("export_fidelity") or {}
    return {f"export_fidelity.{k}": v for k, v in section.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


def memory_metrics(report: dict) -> dict[str, float]:
    """Each phase's peak RSS as memory.peak_rss_mb.<phase> (export, finetuned, base, score)."""
    return {f"memory.peak_rss_mb.{k}": v for k, v in report["memory"]["peak_rss_mb"].items()}


@main_guard
def main() -> None:
    confine("evaluate")  # only the credentials this stage uses, before any work
    parser = argparse.ArgumentParser(prog="python -m tasks.evaluate", description=__doc__)
    parser.add_argument(
        "--model", type=Path, required=True,
        help="the fine-tune: the train stage's output (a pipeline, or adapters for --base)",
    )
    parser.add_argument(
        "--export", type=Path, default=None,
        help="its OpenVINO export, compared with it apart from the gains (export fidelity)",
    )
    parser.add_argument("--base", type=Path, required=True, help="base diffusers pipeline folder")
    parser.add_argument("--instance-data", type=Path, required=True, help="instance images folder")
    parser.add_argument("--out", type=Path, required=True, help="plots folder to write")
    parser.add_argument("--report", type=Path, required=True, help="JSON report (DVC metrics)")
    parser.add_argument(
        "--heldout-data", type=Path, default=None,
        help="held-out captioned images (imagefolder) for evaluate.heldout (full fine-tunes)",
    )
    parser.add_argument(
        "--metrics", type=Path, default=None,
        help="also write the flat numeric metrics here (DVC metrics for `dvc metrics diff`)",
    )
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    args = parser.parse_args()
    params = read_params(args.params)  # train's facts the evaluation follows: its precision, image-to-video
    cfg = following_train_i2v(following_train("evaluate", load_config("evaluate", EvaluateConfig, args.params),
                                              params), params)
    check_replaceable(args.out)  # before minutes of generation, not after
    with stage_run("evaluate", params=cfg.model_dump()) as run:
        result = evaluate(args.model, args.base, args.instance_data, cfg,
                          heldout=args.heldout_data, export=export_or_none(args.export))
        with atomic_dir(args.out) as tmp:
            written = write_plots(result, tmp, cfg.images_per_prompt)
            run.log_artifact(tmp, "evaluate")
        write_json(args.report, result.report)
        if args.metrics is not None:
            write_json(args.metrics, flat_metrics(result.report))
        run.log_metrics({k: v for k, v in result.report["metrics"].items() if v is not None})
        run.log_metrics(fidelity_metrics(result.report))
        run.log_metrics({f"seconds.{k}": v for k, v in result.report["seconds"].items()})
        run.log_metrics(memory_metrics(result.report))
        run.log_table(result.rows, "evaluate/per_prompt_table.json")
        if result.edit_rows:
            run.log_table(result.edit_rows, "evaluate/per_edit_table.json")
        if result.extra.get("i2v"):
            run.log_table(result.extra["i2v"]["rows"], "evaluate/per_i2v_table.json")
        run.log_dict(result.report, "evaluate.json")
        gate = result.report["gate"]
        protocol = result.report["protocol"]
        run.set_tags({"gate.passed": str(gate["passed"]).lower(), "protocol": protocol["id"],
                      "protocol.calibrated": str(protocol["calibrated"]).lower(),
                      "base_cache": str(result.report["generation"]["base_cache"]),
                      **({"protocol.note": protocol["uncalibrated_reason"]}
                         if not protocol["calibrated"] else {})})
    log.info(
        "evaluation report %s; gate %s; grids and per-prompt table in %s (%s)",
        args.report,
        "passed" if gate["passed"] else "NOT passed",
        args.out,
        ", ".join(p.name for p in written.values()),
    )


if __name__ == "__main__":
    main()
