"""The evaluation protocol: everything that changes a score, fingerprinted.

Two scores can be compared only when they were measured the same way: the same encoders (ids and
revisions, or built-in names and their seed), prompts and CLIP-T texts, seeds, images per prompt,
steps, guidance, resolution, reference and held-out images, the backend and precision the
fine-tune and the base are generated with (PyTorch fp32 for both: like with like), and which
prompts the OpenVINO export is compared on (export fidelity, reported apart), and the edit set
(its triples' content, when the instance data is an edit dataset). `describe`
gathers those settings into the report's `protocol` section with a short `id` (a hash of them):
equal ids, comparable scores. Promotion (tasks/register/promotion.py) compares a challenger with
the champion only under the same id.

`calibrated` is false when an encoder is a built-in one: their weights are random (seeded), so
their scores say nothing about likeness or prompt fidelity; the report, the MLflow run and the
registry say so in words.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

from PIL import Image

from tasks.evaluate.config import EvaluateConfig

BUILTIN = "builtin:"


def images_hash(images: list[Image.Image]) -> str:
    """A content hash of decoded images (size, mode and pixels), in order."""
    h = hashlib.sha256()
    for image in images:
        h.update(f"{image.size}{image.mode}".encode())
        h.update(image.tobytes())
    return h.hexdigest()[:16]


def _encoder(name: str, revision: str | None, seed: int) -> dict[str, Any]:
    if name.startswith(BUILTIN):
        return {"name": name, "seed": seed}
    return {"name": name, "revision": revision}


def uncalibrated_reason(cfg: EvaluateConfig) -> str | None:
    """Why the scores are not calibrated (None: both encoders are trained ones)."""
    builtin = [n for n in (cfg.clip_model, cfg.dino_model) if n.startswith(BUILTIN)]
    if not builtin:
        return None
    verb = "have" if len(builtin) > 1 else "has"
    return (f"uncalibrated scores: {' and '.join(builtin)} {verb} random (seeded) weights, so "
            "CLIP-T, CLIP-I and DINO do not measure likeness here; set evaluate.clip_model and "
            "evaluate.dino_model to trained encoders (docs/parameters.md) for meaningful scores")


def describe(cfg: EvaluateConfig, *, prompts: list[str], clip_texts: list[str], backend: str,
             precision: dict[str, str], shape: dict[str, Any], instance: str,
             heldout: str | None, base_backend: str | None,
             export_fidelity: int | None | bool = False,
             edits: dict[str, Any] | None = None,
             image_to_video: dict[str, Any] | None = None) -> dict[str, Any]:
    """The report's `protocol` section: {id, calibrated, uncalibrated_reason, settings}.

    `backend` / `precision` are the fine-tune's (the gains': `base_backend` is the base's, the
    same); `export_fidelity` is False when the export was not compared, else its max_prompts
    (None: all prompts); `edits`: the edit set scored ({set: its content hash, pairs}), None
    without one (then left out of the settings, so evaluations without edits keep their ids);
    `image_to_video`: the subject clips continued from their first frames ({set, clips}), None (left
    out) without them."""
    settings = {
        "clip": _encoder(cfg.clip_model, cfg.clip_revision, cfg.encoder_seed),
        "dino": _encoder(cfg.dino_model, cfg.dino_revision, cfg.encoder_seed),
        "prompts": prompts,
        "clip_t_texts": clip_texts,
        "seed": cfg.seed,
        "images_per_prompt": cfg.images_per_prompt,
        "num_inference_steps": cfg.num_inference_steps,
        "guidance_scale": cfg.guidance_scale,
        "shape": shape,
        "backend": backend,
        "precision": precision,
        "base_backend": base_backend,
        "export_fidelity": (None if export_fidelity is False
                            else {"max_prompts": export_fidelity}),
        "instance_images": instance,
        "heldout_images": heldout,
        "drift": cfg.drift.model_dump() if cfg.drift.enabled else None,
    }
    if edits is not None:
        settings["edits"] = edits
    if image_to_video is not None:
        settings["image_to_video"] = image_to_video
    text = json.dumps(settings, sort_keys=True, separators=(",", ":"))
    reason = uncalibrated_reason(cfg)
    return {"id": hashlib.sha256(text.encode()).hexdigest()[:12], "calibrated": reason is None,
            "uncalibrated_reason": reason, "settings": settings}
