"""The checkpoint that is best, not the last: score each checkpoint, guard against collapse, check movement.

At every checkpoint the validation images (fixed prompts and seeds) are scored the way the
`evaluate` stage scores (tasks/common/scoring.py: CLIP-T against the prompt without the
identifier, CLIP-I and DINO against the instance images). Loss is a poor guide: a run can
diverge late, its loss still falling while its samples go black.

A checkpoint is **collapsed**, and never chosen, when
- its loss or any of its scores is not finite (NaN weights never reach a checkpoint: the loop
  refuses to save them), or
- at least half of its validation images are collapsed: *near-black* (mean of every 8-bit pixel
  value below NEAR_BLACK_MEAN = 16, about 6 % brightness) or *near-uniform* (standard deviation
  of the pixel values below NEAR_UNIFORM_STD = 4 of 255: one flat colour, white or grey included).

The trained weights must have **moved**: a fingerprint (float64 sum and sum of squares of every
trainable tensor) is taken after the method set them up and before any resume; when the output's
trainable weights still match it everywhere, the stage fails (learning rate 0, LoRA adapters at
their initial values, nothing receiving gradients).
"""
from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from tasks.common.errors import UserError
from tasks.common.scoring import Encoders, Scorer, clip_t_text, load_instance_images
from tasks.train.config import CheckpointScoringConfig

log = logging.getLogger(__name__)

#: An image whose mean 8-bit value is below this is near-black.
NEAR_BLACK_MEAN = 16.0
#: An image whose 8-bit values have a standard deviation below this is near-uniform.
NEAR_UNIFORM_STD = 4.0
#: A checkpoint is collapsed when at least this share of its validation images is.
COLLAPSED_SHARE = 0.5


def image_collapse(image: Image.Image) -> str | None:
    """'near-black', 'near-uniform' or None for a healthy-looking image."""
    pixels = np.asarray(image.convert("RGB"), dtype=np.float64)
    if pixels.mean() < NEAR_BLACK_MEAN:
        return "near-black"
    if pixels.std() < NEAR_UNIFORM_STD:
        return "near-uniform"
    return None


def collapse_reason(images: list[Image.Image], loss: float, scores: dict[str, float]) -> str | None:
    """Why a checkpoint counts as collapsed, or None."""
    if not math.isfinite(loss):
        return f"loss {loss}"
    bad = [k for k, v in scores.items() if not math.isfinite(v)]
    if bad:
        return f"non-finite {', '.join(bad)}"
    kinds = [k for k in map(image_collapse, images) if k]
    if images and len(kinds) >= COLLAPSED_SHARE * len(images):
        counts = {k: kinds.count(k) for k in sorted(set(kinds))}
        return f"{len(kinds)} of {len(images)} validation images " + ", ".join(f"{n} {k}" for k, n in counts.items())
    return None


class CheckpointJudge:
    """Scores a checkpoint's validation images and picks the best healthy checkpoint.

    `scores`: False on the ranks other than 0, which make no validation images and receive the
    records from rank 0 (loop.py), so they do not load the encoders at all.
    """

    def __init__(self, scoring: CheckpointScoringConfig, prompts: list[str], instance_dir: Path,
                 scores: bool = True, frames: int = 1) -> None:
        self.metric, self.goal = scoring.scored_metric(), str(scoring.goal)
        self.prompts = list(prompts)
        self.scorer: Scorer | None = None
        if not scores:
            return
        with torch.random.fork_rng():  # built-in encoders seed torch: the training RNG must not move
            encoders = Encoders.load(str(scoring.clip_model), str(scoring.dino_model), int(scoring.encoder_seed or 0),
                                     scoring.clip_revision, scoring.dino_revision, key="train.checkpoint_scoring")
        texts = encoders.clip.embed_texts([clip_t_text(p, scoring.identifier) for p in self.prompts])
        self.scorer = Scorer(encoders.clip, encoders.dino, texts, load_instance_images(instance_dir), frames)

    def score(self, step: int, images: dict[str, list[Image.Image]], loss: float) -> dict[str, Any]:
        """The report's record of one checkpoint: step, loss, scores and whether it collapsed."""
        if self.scorer is None:
            raise RuntimeError("this judge was made without encoders (scores=False): only rank 0 scores")
        rows = [images.get(p, []) for p in self.prompts]
        overall = self.scorer.scores(rows)[0]
        flat = [im for row in rows for im in row]
        reason = collapse_reason(flat, loss, overall)
        record = {"step": step, "loss": loss, **{k: round(v, 6) if math.isfinite(v) else v
                                                 for k, v in overall.items()},
                  "collapsed": reason is not None, "collapse_reason": reason}
        log.info("checkpoint %d: CLIP-T %.4f, CLIP-I %.4f, DINO %.4f%s", step, overall["clip_t"],
                 overall["clip_i"], overall["dino"], f"; COLLAPSED ({reason})" if reason else "")
        return record

    def best(self, records: list[dict[str, Any]]) -> dict[str, Any] | None:
        """The healthy record best on the metric (the earliest among equals); None when all collapsed."""
        return best_record(records, self.metric, self.goal)


def best_record(records: list[dict[str, Any]], metric: str, goal: str) -> dict[str, Any] | None:
    healthy = [r for r in records if not r["collapsed"] and math.isfinite(r[metric])]
    if not healthy:
        return None
    sign = 1.0 if goal == "maximize" else -1.0
    return max(healthy, key=lambda r: (sign * r[metric], -r["step"]))


class WeightsNeverMoved(UserError):
    """The trained weights are still their initial values after training."""


class WeightsAnchor:
    """A fingerprint of the trainable weights as the method set them up (before step 1)."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.initial = [self._fingerprint(p) for p in params]

    @staticmethod
    def _fingerprint(p: torch.Tensor) -> tuple[float, float]:
        with torch.no_grad():
            x = p.detach().to(torch.float64)
            return float(x.sum()), float((x * x).sum())

    def check(self, params: list[torch.Tensor], method: str, steps: int, lr: float) -> int:
        """The number of tensors that changed; raises WeightsNeverMoved when none did."""
        moved = sum(self._fingerprint(p) != f for p, f in zip(params, self.initial, strict=True))
        if moved == 0:
            raise WeightsNeverMoved(
                f"the trained weights never moved from their initial state: after {steps} step(s) all "
                f"{len(params)} trainable tensors of {method} are unchanged (learning rate at the last step "
                f"{lr:.3g}). Nothing was written to --out. Check train.learning_rate (with lr_scheduler and "
                "lr_warmup_steps the rate may be 0 for the whole run), that max_train_steps is large enough, "
                "and for lora that the adapters receive gradients (rank, train_text_encoder)")
        return moved
