"""Evaluate: generate with the exported model (and the base), score CLIP-T / CLIP-I / DINO, gate.

Pure work: returns the report, the per-prompt rows and the grids; the CLI writes and logs them.
"""
from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from tasks.common import families
from tasks.common.errors import UserError
from tasks.common.images import to_rgb
from tasks.common.openvino_model import (
    StaticShape,
    compiled_precisions,
    load_ov_pipeline,
    static_shape,
)
from tasks.common.tiny_encoders import LoadedEncoder, load_clip, load_dino
from tasks.evaluate import extra_metrics as X
from tasks.evaluate import metrics as M
from tasks.evaluate import protocol as P
from tasks.evaluate.config import EvaluateConfig
from tasks.evaluate.generate import generate
from tasks.evaluate.prompts import prompt_templates

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".bmp"}


@dataclass
class Result:
    report: dict[str, Any]
    rows: list[dict[str, Any]]
    images: list[list[Image.Image]]
    base_images: list[list[Image.Image]] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


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


def load_instance_images(folder: Path) -> list[Image.Image]:
    """The processed instance images: those listed in metadata.jsonl, else every image file."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"{folder} does not exist: run the ingest stage first (dvc repro ingest)")
    meta = folder / "metadata.jsonl"
    if meta.is_file():
        lines = [line for line in meta.read_text().splitlines() if line.strip()]
        paths = [folder / json.loads(line)["file_name"] for line in lines]
    else:
        paths = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if not paths:
        raise UserError(f"{folder} holds no instance images; check the ingest stage's report")
    images = []
    for path in paths:
        with Image.open(path) as im:
            images.append(to_rgb(im).copy())
    return images


def _default_shape(pipe: Any) -> StaticShape:
    """For a dynamic pipeline: one prompt, one image per call, at the denoiser's native size."""
    size = families.of_pipeline(pipe).native_size(pipe)
    return StaticShape(1, size, size, 1)


def _load_base(path: Path) -> Any:
    import torch
    from diffusers import DiffusionPipeline

    if not (Path(path) / "model_index.json").is_file():
        raise UserError(
            f"{path} is not a diffusers pipeline: run the base stage (dvc repro base); with "
            "evaluate.backend pytorch, --model must be a diffusers folder too (models/finetuned)"
        )
    return DiffusionPipeline.from_pretrained(path, torch_dtype=torch.float32)


def _scores(
    images: list[list[Image.Image]],
    texts: np.ndarray,
    clip: LoadedEncoder,
    dino: LoadedEncoder,
    real_clip: np.ndarray,
    real_dino: np.ndarray,
) -> tuple[dict[str, float], list[dict[str, float]]]:
    """Overall and per-prompt CLIP-T, CLIP-I, DINO of one model's images."""
    flat = [im for row in images for im in row]
    prompt_of = [p for p, row in enumerate(images) for _ in row]
    clip_emb, dino_emb = clip.embed_images(flat), dino.embed_images(flat)
    clip_t = M.clip_t_scores(texts, clip_emb, prompt_of)
    clip_i = M.cosine_matrix(clip_emb, real_clip).mean(axis=1)  # per image, over the real images
    dino = M.cosine_matrix(dino_emb, real_dino).mean(axis=1)
    idx = np.asarray(prompt_of)
    per_prompt = [
        {"clip_t": float(clip_t[idx == p].mean()), "clip_i": float(clip_i[idx == p].mean()),
         "dino": float(dino[idx == p].mean())}
        for p in range(len(images))
    ]
    overall = {
        "clip_t": float(clip_t.mean()), "clip_i": float(clip_i.mean()), "dino": float(dino.mean())
    }
    return overall, per_prompt


def _load_model(model: Path, backend: str) -> tuple[Any, str, StaticShape]:
    """(pipeline, backend label, call shape) for `evaluate.backend`."""
    if backend == "pytorch":
        pipe = _load_base(model)
        return pipe, "pytorch", _default_shape(pipe)
    pipe = load_ov_pipeline(model, static=True)
    shape = static_shape(pipe)
    return pipe, "openvino-static" if shape else "openvino-dynamic", shape or _default_shape(pipe)


def evaluate(model: Path, base: Path | None, instance_data: Path, cfg: EvaluateConfig,
             heldout: Path | None = None) -> Result:
    """Generate, score and gate; `base=None` (or compare_base false) skips the base model.

    `heldout`: captioned held-out images for `evaluate.heldout` (full fine-tunes)."""
    prompts, clip_texts = render_prompts(cfg)
    real_images = load_instance_images(instance_data)
    clip = load_clip(cfg.clip_model, cfg.encoder_seed, cfg.clip_revision, "evaluate.clip_model")
    dino = load_dino(cfg.dino_model, cfg.encoder_seed, cfg.dino_revision, "evaluate.dino_model")

    pipe, backend, shape = _load_model(model, cfg.backend)
    # what the export's openvino_runtime.json made OpenVINO compute in (PyTorch: fp32)
    precision = compiled_precisions(pipe) if backend != "pytorch" else {"all": "f32"}
    n = cfg.images_per_prompt
    log.info("generating %d x %d images with %s at %s", len(prompts), n, backend, shape)
    common = dict(shape=shape, seed=cfg.seed, num_inference_steps=cfg.num_inference_steps,
                  guidance_scale=cfg.guidance_scale)
    gen_args = dict(prompts=prompts, images_per_prompt=cfg.images_per_prompt, **common)
    with_base = cfg.compare_base and base is not None
    drift_args = dict(
        prompts=X.drift_prompts(cfg.drift.prompts, cfg.identifier, cfg.class_name),
        images_per_prompt=cfg.drift.images_per_prompt, **common,
    ) if cfg.drift.enabled and with_base else None
    heldout_data = None
    if cfg.heldout.enabled:
        if heldout is None:
            raise UserError(
                "evaluate.heldout.enabled needs --heldout-data (held-out captioned images)"
            )
        heldout_data = X.load_heldout(heldout, cfg.heldout.max_images)
        heldout_args = dict(prompts=heldout_data[0], images_per_prompt=1, **common)

    def run_all(p: Any, who: str) -> dict[str, Any]:
        out = {"main": generate(p, desc=f"{who}", **gen_args)}
        if drift_args:
            out["drift"] = generate(p, desc=f"{who}: class prompts", **drift_args)
        if heldout_data is not None:
            out["heldout"] = generate(p, desc=f"{who}: held-out captions", **heldout_args)
        return out

    tuned = run_all(pipe, f"fine-tuned ({backend})")
    del pipe
    images = tuned["main"][0]
    seconds = {"generate_finetuned": round(sum(v[1] for v in tuned.values()), 3)}

    base_images, based = None, {}
    if with_base:
        base_pipe = _load_base(base)
        based = run_all(base_pipe, "base (PyTorch)")
        del base_pipe
        base_images = based["main"][0]
        seconds["generate_base"] = round(sum(v[1] for v in based.values()), 3)

    start = time.perf_counter()
    text_emb = clip.embed_texts(clip_texts)
    real_clip, real_dino = clip.embed_images(real_images), dino.embed_images(real_images)
    overall, per_prompt = _scores(images, text_emb, clip, dino, real_clip, real_dino)
    metrics: dict[str, float] = dict(overall)
    base_per_prompt = None
    if base_images is not None:
        base_overall, base_per_prompt = _scores(
            base_images, text_emb, clip, dino, real_clip, real_dino
        )
        for name, value in base_overall.items():
            metrics[f"base_{name}"] = value
            metrics[f"gain_{name}"] = overall[name] - value
    rows = []
    for p in range(len(prompts)):  # prompt, clip_t_text, then each metric beside its base value
        row: dict[str, Any] = {"prompt": prompts[p], "clip_t_text": clip_texts[p]}
        for name in ("clip_t", "clip_i", "dino"):
            row[name] = round(per_prompt[p][name], 6)
            if base_per_prompt is not None:
                row[f"{name}_base"] = round(base_per_prompt[p][name], 6)
        rows.append(row)
    if drift_args:
        metrics.update(X.drift_scores(tuned["drift"][0], based["drift"][0], clip, dino))
    if heldout_data is not None:
        captions, real_heldout = heldout_data
        metrics.update(X.heldout_scores(tuned["heldout"][0], captions, real_heldout, clip))
        metrics["real_heldout_clip_t"] = X.heldout_reference(captions, real_heldout, clip)
        if with_base:
            metrics.update(X.heldout_scores(based["heldout"][0], captions, real_heldout, clip,
                                            prefix="base_"))
    metrics["real_clip_i"] = M.mean_self_cosine(real_clip)
    metrics["real_dino"] = M.mean_self_cosine(real_dino)
    seconds["score"] = round(time.perf_counter() - start, 3)

    verdict = M.gate(metrics, cfg.gate.model_dump())
    report = {
        "metrics": {k: M._json_number(v) for k, v in metrics.items()},
        "gate": verdict,
        "prompts": prompts,
        "clip_t_texts": clip_texts,
        "images": {
            "per_prompt": cfg.images_per_prompt,
            "generated": sum(map(len, images)),
            "instance": len(real_images),
            "height": shape.height,
            "width": shape.width,
        },
        "generation": {
            "backend": backend,
            "precision": precision,
            "call_shape": shape.as_dict(),
            "base_compared": base_images is not None,
            "prompt_set": cfg.prompt_set,
            "drift_prompts": drift_args["prompts"] if drift_args else [],
            "heldout_images": len(heldout_data[0]) if heldout_data else 0,
        },
        "encoders": {"clip": cfg.clip_model, "dino": cfg.dino_model, "clip_dim": clip.embedding_dim,
                     "dino_dim": dino.embedding_dim},
        "protocol": P.describe(
            cfg, prompts=prompts, clip_texts=clip_texts, backend=backend, precision=precision,
            shape=shape.as_dict(), instance=P.images_hash(real_images),
            heldout=P.images_hash(heldout_data[1]) if heldout_data else None,
            base_backend="pytorch" if base_images is not None else None),
        "seconds": seconds,
        "reference_dreambooth_paper_table1": M.PAPER_TABLE1,
    }
    log.info(
        "CLIP-T %.3f, CLIP-I %.3f, DINO %.3f; gate %s; protocol %s",
        metrics["clip_t"],
        metrics["clip_i"],
        metrics["dino"],
        "passed" if verdict["passed"] else "FAILED",
        report["protocol"]["id"],
    )
    if not report["protocol"]["calibrated"]:
        log.warning("%s", report["protocol"]["uncalibrated_reason"])
    return Result(report, rows, images, base_images)
