"""Scoring generated images the evaluation protocol's way; shared by `evaluate` and `train`.

- CLIP-T (prompt fidelity): cosine between a prompt's CLIP text embedding and the CLIP image
  embedding of each image generated for it.
- CLIP-I and DINO (subject fidelity): cosine of each generated image's CLIP resp. DINO image
  embedding with every real instance image, averaged.

A video model's clip (`frames` > 1: each generated image is a filmstrip of that many frames side by
side, as the family's `generate` makes it) is scored frame by frame and averaged per clip, against
the instance clips' frames (`load_instance_images`); it also gets `temporal_consistency`, the mean
cosine of consecutive frames' DINO embeddings (1: the frames do not change).

`evaluate` scores the fine-tune and the base with this; `train` scores the validation images of
each checkpoint with it to keep the best one. Embeddings are L2-normalised (N, D) arrays.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from tasks.common.errors import UserError
from tasks.common.images import to_rgb
from tasks.common.tiny_encoders import LoadedEncoder, load_clip, load_dino

#: The metrics a set of generated images gets without a second model (base or export): what
#: `Scorer.scores` returns, evaluate reports (and the export's deltas) and checkpoints are ranked by.
IMAGE_METRICS = ("clip_t", "clip_i", "dino")
#: a clip's extra metric (video models): how alike its consecutive frames are
TEMPORAL = "temporal_consistency"
#: frames of each instance clip that are its subject images (evenly spaced, the first and last among them)
FRAMES_PER_CLIP = 4
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".bmp"}


def unit_rows(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2:
        raise ValueError(f"expected a 2-D array of embeddings, got shape {x.shape}")
    norm = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.where(norm == 0, 1.0, norm)


def cosine_matrix(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(N, M) cosines between the rows of a (N, D) and b (M, D); rows are normalised here too."""
    a, b = unit_rows(a), unit_rows(b)
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"embedding sizes differ: {a.shape[1]} vs {b.shape[1]}")
    return a @ b.T


def clip_t_scores(text: np.ndarray, images: np.ndarray, prompt_of_image: list[int]) -> np.ndarray:
    """Per-image CLIP-T: cosine between image i and the text of its prompt `prompt_of_image[i]`."""
    if len(prompt_of_image) != len(images):
        raise ValueError("prompt_of_image needs one prompt index per image")
    sims = cosine_matrix(images, text)
    return sims[np.arange(len(images)), np.asarray(prompt_of_image, dtype=int)]


def clip_t_text(prompt: str, identifier: str | None) -> str:
    """What CLIP-T reads for `prompt`: the prompt without the rare-token identifier (it means
    nothing to CLIP; the score is about following the context)."""
    if identifier:
        prompt = re.sub(rf"(?<!\w){re.escape(identifier)}(?!\w)", " ", prompt)
    return re.sub(r"\s+", " ", prompt).strip()


def load_instance_images(folder: Path) -> list[Image.Image]:
    """The processed instance images: those listed in metadata.jsonl, else every image file; where
    there are none but clips (clips.jsonl), FRAMES_PER_CLIP frames of each clip."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"{folder} does not exist: run the ingest stage first (dvc repro ingest)")
    meta = folder / "metadata.jsonl"
    if meta.is_file():
        lines = [line for line in meta.read_text().splitlines() if line.strip()]
        paths = [folder / json.loads(line)["file_name"] for line in lines]
    else:
        paths = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if not paths and (folder / "clips.jsonl").is_file():
        paths = _clip_frames(folder)
    if not paths:
        raise UserError(f"{folder} holds no instance images; check the ingest stage's report")
    images = []
    for path in paths:
        with Image.open(path) as im:
            images.append(to_rgb(im).copy())
    return images


def _clip_frames(folder: Path) -> list[Path]:
    """FRAMES_PER_CLIP evenly spaced frames of each clip clips.jsonl lists."""
    paths = []
    for line in (folder / "clips.jsonl").read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            names = row["frame_files"]
            picks = np.linspace(0, len(names) - 1, min(FRAMES_PER_CLIP, len(names))).round().astype(int)
            paths += [folder / row["file_name"] / names[i] for i in dict.fromkeys(picks.tolist())]
    return paths


def split_frames(strip: Image.Image, frames: int) -> list[Image.Image]:
    """A filmstrip of `frames` equal frames side by side, as its frames."""
    width = strip.width // frames
    return [strip.crop((k * width, 0, (k + 1) * width, strip.height)) for k in range(frames)]


@dataclass
class Encoders:
    clip: LoadedEncoder
    dino: LoadedEncoder

    @classmethod
    def load(cls, clip_model: str, dino_model: str, seed: int = 0, clip_revision: str | None = None,
             dino_revision: str | None = None, key: str = "evaluate") -> Encoders:
        """The two encoders by built-in name, folder or hub id; `key` names the params section in errors."""
        return cls(load_clip(clip_model, seed, clip_revision, f"{key}.clip_model"),
                   load_dino(dino_model, seed, dino_revision, f"{key}.dino_model"))


class Scorer:
    """CLIP-T / CLIP-I / DINO of generated images against prompt texts and the instance images;
    `frames` > 1: each image is a clip's filmstrip, scored per frame (module docstring)."""

    def __init__(self, clip: LoadedEncoder, dino: LoadedEncoder, texts: np.ndarray, real: list[Any],
                 frames: int = 1) -> None:
        self.clip, self.dino, self.texts, self.frames = clip, dino, texts, frames
        self.real_clip, self.real_dino = clip.embed_images(real), dino.embed_images(real)

    def scores(self, images: list[list[Any]]) -> tuple[dict[str, float], list[dict[str, float]]]:
        """Overall and per-prompt scores of images[p][j] (prompt p's j-th image or clip)."""
        f = self.frames
        flat = [frame for row in images for im in row for frame in (split_frames(im, f) if f > 1 else [im])]
        prompt_of = [p for p, row in enumerate(images) for _ in row for _ in range(f)]
        clip_emb, dino_emb = self.clip.embed_images(flat), self.dino.embed_images(flat)
        clip_t = clip_t_scores(self.texts[: len(images)], clip_emb, prompt_of)
        clip_i = cosine_matrix(clip_emb, self.real_clip).mean(axis=1)  # per image, over the real images
        dino = cosine_matrix(dino_emb, self.real_dino).mean(axis=1)
        per_image = {name: value.reshape(-1, f).mean(axis=1)  # per clip: the mean of its frames
                     for name, value in zip(IMAGE_METRICS, (clip_t, clip_i, dino), strict=True)}
        if f > 1:
            clips = unit_rows(dino_emb).reshape(-1, f, dino_emb.shape[1])
            per_image[TEMPORAL] = (clips[:, 1:] * clips[:, :-1]).sum(axis=2).mean(axis=1)
        idx = np.asarray(prompt_of[::f])
        per_prompt = [{k: float(v[idx == p].mean()) for k, v in per_image.items()} for p in range(len(images))]
        overall = {k: float(v.mean()) for k, v in per_image.items()}
        return overall, per_prompt

    def overall(self, images: list[list[Any]], n: int) -> dict[str, float]:
        return self.scores(images[:n])[0]
