"""Evaluate: fine-tune and base in PyTorch, like with like (gains), the export apart (fidelity); score, gate.

Pure work: returns the report, the per-prompt rows and the grids; the CLI writes and logs them. The
images are made one pipeline at a time (phases.py), the base's possibly read from the base image cache
(base_cache.py); the scoring encoders load after the last pipeline is gone. tasks/evaluate/README.md.
"""
from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image

from tasks.common import families
from tasks.common.errors import UserError
from tasks.common.memory import PhasePeaks, release_memory
from tasks.common.openvino_model import StaticShape
from tasks.common.scoring import IMAGE_METRICS, Encoders, Scorer, load_instance_images
from tasks.common.tiny_encoders import check_encoder
from tasks.evaluate import edits as E
from tasks.evaluate import extra_metrics as X
from tasks.evaluate import fidelity as F
from tasks.evaluate import image_to_video as I
from tasks.evaluate import metrics as M
from tasks.evaluate import protocol as P
from tasks.evaluate.config import EvaluateConfig, quantized
from tasks.evaluate.phases import Generated, generate_all
from tasks.evaluate.prompts import prompt_templates

log = logging.getLogger(__name__)

@dataclass
class Result:
    report: dict[str, Any]
    rows: list[dict[str, Any]]
    images: list[list[Image.Image]]
    base_images: list[list[Image.Image]] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    edit_rows: list[dict[str, Any]] = field(default_factory=list)  # one per triple of the edit set


def render_prompts(cfg: EvaluateConfig) -> tuple[list[str], list[str]]:
    """(generation prompts, CLIP-T texts). CLIP-T reads the prompt without the identifier: the
    rare token means nothing to CLIP, and the score is about following the context."""
    templates = prompt_templates(cfg.prompt_set, cfg.prompts, cfg.max_prompts)
    prompts = [p.format(identifier=cfg.identifier, class_name=cfg.class_name) for p in templates]
    texts = [
        re.sub(r"\s+", " ", p.format(identifier="", class_name=cfg.class_name)).strip()
        for p in templates
    ]
    return prompts, texts


def evaluate(model: Path, base: Path | None, instance_data: Path, cfg: EvaluateConfig,
             heldout: Path | None = None, export: Path | None = None) -> Result:
    """Generate, score and gate. `model` is the fine-tune (a pipeline, or adapters for `base`);
    it and the base run in PyTorch fp32 for the gains (or both on a quantized denoiser:
    evaluate.base_model_precision); `export` (OpenVINO), when given and
    `export_fidelity` is enabled, is compared with the PyTorch fine-tune and sets the call shape.

    `base=None` (or compare_base false) skips the base model; `heldout`: captioned held-out
    images for `evaluate.heldout` (full fine-tunes)."""
    if cfg.heldout.enabled and heldout is None:
        raise UserError("evaluate.heldout.enabled needs --heldout-data (held-out captioned images)")
    prompts, clip_texts = render_prompts(cfg)
    real_images = load_instance_images(instance_data)
    triples = _edit_set(instance_data, cfg)
    starts = _starts(model, base, instance_data, cfg, prompts)  # refused before any pipeline loads
    if triples:  # refused before any pipeline loads (the export's fidelity images come first)
        E.refuse_family(_family_of(model, base), triples)
    if not triples and (base is not None or (Path(model) / "model_index.json").is_file()):  # (adapters without
        E.refuse_no_input(_family_of(model, base), triples, instance_data)  # a base are refused as they load)
    held = quantized(cfg)
    if held is not None and (problem := held.problem("cpu", key="base_model_precision", section="evaluate")):
        raise UserError(problem)
    check_encoder(cfg.clip_model, "evaluate.clip_model", cfg.clip_revision)  # before minutes of generation
    check_encoder(cfg.dino_model, "evaluate.dino_model", cfg.dino_revision)
    peaks = PhasePeaks()
    made = generate_all(model, base, cfg.compare_base and base is not None, prompts, cfg, heldout, export,
                        triples, peaks, starts)
    frames = _family_of(model, base).call_convention().frames or 1  # a video model's clips: scored per frame
    with peaks.phase("score"):  # the encoders load once every pipeline is gone
        start = time.perf_counter()
        scores = _score(cfg, made, triples, prompts, clip_texts, real_images, frames)
        made.seconds["score"] = round(time.perf_counter() - start, 3)
        release_memory()
    report = _gate_and_report(cfg, scores, made, prompts, clip_texts, real_images)
    report["memory"] = {"peak_rss_mb": peaks.peaks}
    report["edits"] = {"pairs": len(triples), "rows": scores.edit_rows} if triples else None
    edit_grid = (E.grid_cells(triples, made.tuned["edits"][0], made.based["edits"][0] if made.based else None)
                 if triples else None)
    report["image_to_video"] = ({"clips": [s.clip for s in starts], "prompts": [s.caption for s in starts],
                                 "rows": scores.i2v_rows} if starts else None)
    i2v = ({"images": made.tuned["i2v"][0], "base_images": made.based["i2v"][0] if made.based else None,
            "rows": scores.i2v_rows} if starts else None)
    return Result(report, scores.rows, made.tuned["main"][0], made.based["main"][0] if made.based else None,
                  {"export_images": made.exported["images"] if made.exported else None,
                   "edit_grid": edit_grid, "frames": frames, "i2v": i2v}, scores.edit_rows)


@dataclass
class _Scores:
    metrics: dict[str, float]
    rows: list[dict[str, Any]]  # per prompt
    fidelity: dict[str, Any] | None  # the export's (None: not compared)
    edit_rows: list[dict[str, Any]]  # per triple of the edit set
    dims: tuple[int, int]  # the CLIP and DINO embeddings' sizes
    i2v_rows: list[dict[str, Any]] = field(default_factory=list)  # per subject clip continued (image-to-video)


def _score(cfg: EvaluateConfig, made: Generated, triples: list[E.Triple], prompts: list[str],
           clip_texts: list[str], real_images: list[Image.Image], frames: int = 1) -> _Scores:
    """Every score of `made`, with the encoders loaded for it (and dropped on return); `frames` > 1:
    each image is a clip's filmstrip (tasks/common/scoring.py)."""
    encoders = Encoders.load(cfg.clip_model, cfg.dino_model, cfg.encoder_seed, cfg.clip_revision,
                             cfg.dino_revision, key="evaluate")
    scorer = Scorer(encoders.clip, encoders.dino, encoders.clip.embed_texts(clip_texts), real_images, frames)
    metrics, rows = _fine_tuning_metrics(scorer, prompts, clip_texts, made.tuned, made.based, made.heldout)
    edit_metrics, edit_rows = _edit_scores(encoders, triples, made, cfg.identifier)
    metrics.update(edit_metrics)
    i2v_rows: list[dict[str, Any]] = []
    if made.jobs.i2v:  # the image-to-video clips, against their captions and the same subject frames
        i2v_metrics, i2v_rows = I.scores(encoders, real_images, frames, made.jobs.i2v["starts"], made.tuned["i2v"][0],
                                         made.based["i2v"][0] if made.based else None, cfg.identifier)
        metrics.update(i2v_metrics)
    return _Scores(metrics, rows, _export_fidelity(scorer, made), edit_rows,
                   (scorer.clip.embedding_dim, scorer.dino.embedding_dim), i2v_rows)


def _edit_scores(encoders: Encoders, triples: list[E.Triple], made: Generated,
                 identifier: str) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """The edit set's metrics and per-triple rows (none without an edit set)."""
    if not triples:
        return {}, []
    return E.scores(encoders, triples, made.tuned["edits"][0],
                    made.based["edits"][0] if made.based else None, identifier)


def _family_of(model: Path, base: Path | None) -> type[families.ModelFamily]:
    """The fine-tune's family: its own pipeline folder's, else (adapters only) its base's."""
    folder = Path(model) if (Path(model) / "model_index.json").is_file() or base is None else Path(base)
    return families.detect(folder)


def _starts(model: Path, base: Path | None, instance_data: Path, cfg: EvaluateConfig,
            prompts: list[str]) -> list[I.Start]:
    """The subject clips image-to-video continues (none when evaluate.image_to_video.enabled, resolved, is
    false); a UserError, before any generation, where the family cannot or the data holds no clips, or where
    the gate has an image-to-video threshold and there are none to score."""
    if not cfg.image_to_video.enabled:
        if thresholds := cfg.i2v_thresholds():
            raise UserError(f"evaluate.gate.{thresholds[0]} scores image-to-video clips, but "
                            "evaluate.image_to_video is off (train.first_frame_conditioning_p is 0: the model did "
                            f"not train as image-to-video); set evaluate.gate.{thresholds[0]}: null")
        return []
    family = _family_of(model, base)
    if (why := I.refusal(family)) is not None:
        raise UserError(f"evaluate.image_to_video: {why}; set evaluate.image_to_video.enabled: false")
    return I.load_starts(instance_data, cfg.image_to_video.max_clips, prompts[0])


def _edit_set(instance_data: Path, cfg: EvaluateConfig) -> list[E.Triple]:
    """The edit set (empty when the data has no references, or evaluate.edits is off); an edit
    threshold in the gate without one is refused before any generation."""
    triples = E.load_triples(instance_data, cfg.edits.max_pairs) if cfg.edits.enabled else []
    if not triples and cfg.edit_thresholds():
        key = cfg.edit_thresholds()[0]
        raise UserError(f"evaluate.gate.{key} scores the edit set, but {instance_data} lists no reference "
                        "images (metadata.jsonl `reference_file_names`, an edit dataset from ingest); set "
                        f"evaluate.gate.{key}: null, or evaluate on an edit dataset")
    if triples:
        log.info("edit set: %d (references, target, instruction) triples of %s", len(triples), instance_data)
    return triples


def _export_fidelity(scorer: Scorer, made: Generated) -> dict[str, Any] | None:
    """The export's images against the PyTorch fine-tune's of the same prompts and seeds."""
    exported = made.exported
    if not exported:
        return None
    n = len(exported["images"])
    tuned = made.tuned["main"][0][:n]
    return F.section(exported["images"], tuned, scorer.overall(exported["images"], n), scorer.overall(tuned, n),
                     exported["precision"], exported["backend"])


def _gate_and_report(cfg: EvaluateConfig, scores: _Scores, made: Generated, prompts: list[str],
                     clip_texts: list[str], real_images: list[Image.Image]) -> dict[str, Any]:
    """The gate's verdict and the report; its headline in the log."""
    metrics, fidelity = scores.metrics, scores.fidelity
    gate_values = {**metrics, "export_psnr": fidelity["psnr_min"] if fidelity else None}
    verdict = M.gate(gate_values, cfg.gate.model_dump())
    report = _report(cfg, metrics, verdict, prompts, clip_texts, made.tuned["main"][0], real_images,
                     made.shape, made.source, drift=made.jobs.drift, heldout=made.heldout,
                     with_base=bool(made.based), fidelity=fidelity, scorer_dims=scores.dims,
                     edits=made.jobs.edits["triples"] if made.jobs.edits else None, precision=made.precision,
                     starts=made.jobs.i2v["starts"] if made.jobs.i2v else None)
    report["generation"]["base_cache"] = made.base_cache
    report["seconds"] = made.seconds
    log.info("CLIP-T %.3f, CLIP-I %.3f, DINO %.3f; gate %s; protocol %s", metrics["clip_t"],
             metrics["clip_i"], metrics["dino"], "passed" if verdict["passed"] else "FAILED",
             report["protocol"]["id"])
    if "i2v_dino" in metrics:
        log.info("image-to-video: CLIP-T %.3f, CLIP-I %.3f, DINO %.3f, temporal consistency %.3f",
                 metrics["i2v_clip_t"], metrics["i2v_clip_i"], metrics["i2v_dino"], metrics["i2v_temporal_consistency"])
    if "edit_dino" in metrics:
        log.info("edit set: DINO %.3f, CLIP-I %.3f to the targets, CLIP-T %.3f to the instructions",
                 metrics["edit_dino"], metrics["edit_clip_i"], metrics["edit_clip_t"])
    if fidelity:
        log.info("export fidelity (%s vs PyTorch): PSNR mean %.1f dB, min %.1f dB; "
                 "DINO %+.4f", fidelity["backend"], fidelity["psnr_mean"], fidelity["psnr_min"],
                 fidelity["delta_dino"])
    if not report["protocol"]["calibrated"]:
        log.warning("%s", report["protocol"]["uncalibrated_reason"])
    return report


def _fine_tuning_metrics(scorer: Scorer, prompts: list[str], clip_texts: list[str],
                         tuned: dict[str, Any], based: dict[str, Any],
                         heldout_data: Any) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """The fine-tune's scores, the base's and the gains (one backend and precision), per prompt."""
    overall, per_prompt = scorer.scores(tuned["main"][0])
    metrics: dict[str, float] = dict(overall)
    base_per_prompt = None
    if based:
        base_overall, base_per_prompt = scorer.scores(based["main"][0])
        for name, value in base_overall.items():
            metrics[f"base_{name}"] = value
            metrics[f"gain_{name}"] = overall[name] - value
    rows = []
    for p in range(len(prompts)):  # prompt, clip_t_text, then each metric beside its base value
        row: dict[str, Any] = {"prompt": prompts[p], "clip_t_text": clip_texts[p]}
        for name in IMAGE_METRICS:
            row[name] = round(per_prompt[p][name], 6)
            if base_per_prompt is not None:
                row[f"{name}_base"] = round(base_per_prompt[p][name], 6)
        rows.append(row)
    if "drift" in tuned:
        metrics.update(X.drift_scores(tuned["drift"][0], based["drift"][0], scorer.clip,
                                      scorer.dino))
    if heldout_data is not None:
        captions, real_heldout = heldout_data
        metrics.update(X.heldout_scores(tuned["heldout"][0], captions, real_heldout, scorer.clip))
        metrics["real_heldout_clip_t"] = X.heldout_reference(captions, real_heldout, scorer.clip)
        if based:
            metrics.update(X.heldout_scores(based["heldout"][0], captions, real_heldout,
                                            scorer.clip, prefix="base_"))
    metrics["real_clip_i"] = M.mean_self_cosine(scorer.real_clip)
    metrics["real_dino"] = M.mean_self_cosine(scorer.real_dino)
    return metrics, rows


def _report(cfg: EvaluateConfig, metrics: dict[str, float], verdict: dict[str, Any],
            prompts: list[str], clip_texts: list[str], images: list[list[Image.Image]],
            real_images: list[Image.Image], shape: StaticShape, source: dict[str, Any], *,
            drift: dict[str, Any] | None, heldout: Any, with_base: bool,
            fidelity: dict[str, Any] | None, scorer_dims: tuple[int, int],
            edits: list[E.Triple] | None, precision: dict[str, str],
            starts: list[I.Start] | None = None) -> dict[str, Any]:
    return {
        "metrics": {k: M._json_number(v) for k, v in metrics.items()},
        "gate": verdict,
        "export_fidelity": fidelity,
        "prompts": prompts,
        "clip_t_texts": clip_texts,
        "images": {"per_prompt": cfg.images_per_prompt, "generated": sum(map(len, images)),
                   "instance": len(real_images), "height": shape.height, "width": shape.width},
        "generation": {
            "backend": "pytorch", "precision": precision, "finetuned": source,
            "call_shape": shape.as_dict(), "base_compared": with_base,
            "prompt_set": cfg.prompt_set, "drift_prompts": drift["prompts"] if drift else [],
            "heldout_images": len(heldout[0]) if heldout else 0,
            "edit_pairs": len(edits) if edits else 0,
        },
        "encoders": {"clip": cfg.clip_model, "dino": cfg.dino_model,
                     "clip_dim": scorer_dims[0], "dino_dim": scorer_dims[1]},
        "protocol": P.describe(
            cfg, prompts=prompts, clip_texts=clip_texts, backend="pytorch", precision=precision,
            shape=shape.as_dict(), instance=P.images_hash(real_images),
            heldout=P.images_hash(heldout[1]) if heldout else None,
            base_backend="pytorch" if with_base else None,
            export_fidelity=cfg.export_fidelity.max_prompts if fidelity else False,
            edits={"set": E.set_hash(edits), "pairs": len(edits)} if edits else None,
            image_to_video=I.starts_hash(starts) if starts else None),
        "reference_dreambooth_paper_table1": M.PAPER_TABLE1,
    }
