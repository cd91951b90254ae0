"""Language drift and held-out generalisation, beside the paper's subject-fidelity metrics.

- Drift (DreamBooth's "language drift"): fine-tuning on `sks toy` can make every `toy` look
  like the subject. The class prompts go through the fine-tuned and the base model from the same
  seeds; the paired CLIP-I / DINO cosine of the two images is 1.0 when the class is untouched.
- Held-out (for `full` fine-tunes on a captioned dataset): one image per held-out caption, its
  CLIP-T against the caption, and the Fréchet distance between generated and held-out images in
  the CLIP image encoder's feature space (FID's formula with CLIP features; lower is closer).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
from PIL import Image

from tasks.common.errors import UserError
from tasks.common.images import to_rgb
from tasks.common.tiny_encoders import LoadedEncoder
from tasks.evaluate import metrics as M

log = logging.getLogger(__name__)


def drift_prompts(templates: list[str], identifier: str, class_name: str) -> list[str]:
    return [t.format(identifier=identifier, class_name=class_name) for t in templates]


def drift_scores(
    tuned: list[list[Image.Image]], base: list[list[Image.Image]], clip: LoadedEncoder,
    dino: LoadedEncoder,
) -> dict[str, float]:
    """drift_clip_i / drift_dino: paired cosine of fine-tuned vs base class images."""
    a = [im for row in tuned for im in row]
    b = [im for row in base for im in row]
    return {
        "drift_clip_i": M.paired_cosine(clip.embed_images(a), clip.embed_images(b)),
        "drift_dino": M.paired_cosine(dino.embed_images(a), dino.embed_images(b)),
    }


def load_heldout(folder: Path, limit: int) -> tuple[list[str], list[Image.Image]]:
    """(captions, images) of an imagefolder with metadata.jsonl ({file_name, text}), first `limit`."""
    folder = Path(folder)
    meta = folder / "metadata.jsonl"
    if not meta.is_file():
        raise UserError(
            f"{folder} has no metadata.jsonl: --heldout-data must be an imagefolder of held-out "
            "images with captions (file_name, text), e.g. the ingest stage's output format"
        )
    rows = [json.loads(line) for line in meta.read_text().splitlines() if line.strip()][:limit]
    if len(rows) < 2:
        raise UserError(f"{folder}: the held-out check needs at least 2 captioned images")
    captions, images = [], []
    for row in rows:
        with Image.open(folder / row["file_name"]) as im:
            images.append(to_rgb(im).copy())
        captions.append(str(row.get("text") or ""))
    return captions, images


def heldout_scores(
    generated: list[list[Image.Image]], captions: list[str], real: list[Image.Image],
    clip: LoadedEncoder, prefix: str = "",
) -> dict[str, float]:
    """<prefix>heldout_clip_t (generated vs caption) and <prefix>heldout_fd (CLIP features)."""
    flat = [im for row in generated for im in row]
    gen = clip.embed_images(flat)
    text = clip.embed_texts(captions)
    clip_t = M.clip_t_scores(text, gen, [p for p, row in enumerate(generated) for _ in row])
    return {
        f"{prefix}heldout_clip_t": float(np.mean(clip_t)),
        f"{prefix}heldout_fd": M.frechet_distance(gen, clip.embed_images(real)),
    }


def heldout_reference(captions: list[str], real: list[Image.Image], clip: LoadedEncoder) -> float:
    """CLIP-T of the real held-out images with their own captions: the ceiling to compare with."""
    return float(np.mean(M.clip_t_scores(
        clip.embed_texts(captions), clip.embed_images(real), list(range(len(real)))
    )))

