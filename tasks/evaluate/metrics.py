"""The DreamBooth paper's fidelity metrics on L2-normalised embeddings, and the promotion gate.

- CLIP-T (prompt fidelity): cosine between a prompt's CLIP text embedding and the CLIP image
  embedding of each image generated for it, averaged.
- CLIP-I and DINO (subject fidelity): mean cosine over all pairs (generated image, real instance
  image) of CLIP resp. DINO image embeddings.
- The "real images" reference row: the same mean over distinct pairs of instance images, the
  ceiling a generator can reach with these encoders.
Pure numpy; embeddings come in as (N, D) arrays of unit rows.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from tasks.common.scoring import clip_t_scores, cosine_matrix
from tasks.common.scoring import unit_rows as _unit

__all__ = ["clip_t_scores", "cosine_matrix", "frechet_distance", "gate", "mean_pairwise_cosine",
           "mean_self_cosine", "paired_cosine"]

# DreamBooth paper (Ruiz et al., CVPR 2023), Table 1, for reading our numbers beside theirs.
# Their encoders: DINO ViT-S/16, CLIP ViT-B/32; 30 subjects, 25 prompts, 4 images per prompt.
PAPER_TABLE1 = {
    "real_images": {"dino": 0.774, "clip_i": 0.885, "clip_t": None},
    "dreambooth_imagen": {"dino": 0.696, "clip_i": 0.812, "clip_t": 0.306},
    "dreambooth_stable_diffusion": {"dino": 0.668, "clip_i": 0.803, "clip_t": 0.305},
    "textual_inversion_stable_diffusion": {"dino": 0.569, "clip_i": 0.780, "clip_t": 0.255},
}


def mean_pairwise_cosine(generated: np.ndarray, real: np.ndarray) -> float:
    """CLIP-I / DINO: mean cosine over every (generated, real) pair."""
    if len(generated) == 0 or len(real) == 0:
        return float("nan")
    return float(cosine_matrix(generated, real).mean())


def mean_self_cosine(real: np.ndarray) -> float:
    """Mean cosine over distinct pairs of one set (the paper's "real images" row); nan below 2."""
    n = len(real)
    if n < 2:
        return float("nan")
    sims = cosine_matrix(real, real)
    return float((sims.sum() - np.trace(sims)) / (n * (n - 1)))


def gate(
    metrics: Mapping[str, float | None], thresholds: Mapping[str, float | None]
) -> dict[str, Any]:
    """Check `metrics[name] >= threshold` for every `min_<name>` threshold that is set.

    Returns `{"passed": bool, "checks": {name: {"value", "min", "passed"}}}`. A missing or
    non-finite value fails its check (a model that makes NaNs must not be promoted). With no
    threshold set the gate passes: nothing was asked.
    """
    checks: dict[str, dict[str, Any]] = {}
    for key, minimum in thresholds.items():
        if minimum is None:
            continue
        if not key.startswith("min_"):
            raise ValueError(f"gate keys are min_<metric>, got {key!r}")
        name = key[len("min_"):]
        value = metrics.get(name)
        ok = value is not None and math.isfinite(value) and value >= minimum
        checks[name] = {"value": _json_number(value), "min": minimum, "passed": bool(ok)}
    return {"passed": all(c["passed"] for c in checks.values()), "checks": checks}


def _json_number(value: float | None) -> float | None:
    """JSON has no NaN/inf: those become null."""
    if value is None or not math.isfinite(value):
        return None
    return round(float(value), 6)


def paired_cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Mean cosine of row i of `a` with row i of `b` (same seed through two models)."""
    if a.shape != b.shape:
        raise ValueError(f"paired features need equal shapes, got {a.shape} and {b.shape}")
    return float(np.sum(_unit(a) * _unit(b), axis=1).mean())


def frechet_distance(a: np.ndarray, b: np.ndarray) -> float:
    """Fréchet distance of Gaussians fitted to two feature sets (FID's formula, any encoder).

    |mu_a - mu_b|^2 + Tr(S_a + S_b - 2 (S_a S_b)^1/2). With fewer samples than dimensions the
    covariances are singular; sqrtm still returns the principal root (tiny imaginary parts from
    round-off are dropped), so small evaluation sets give a usable, if noisy, figure.
    """
    from scipy import linalg

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1] or min(len(a), len(b)) < 2:
        raise ValueError("frechet_distance needs two (n >= 2, d) feature arrays of equal d")
    mu_a, mu_b = a.mean(axis=0), b.mean(axis=0)
    cov_a, cov_b = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    covmean = linalg.sqrtm(cov_a @ cov_b)
    if np.iscomplexobj(covmean):
        covmean = covmean.real
    value = float(np.sum((mu_a - mu_b) ** 2) + np.trace(cov_a + cov_b - 2.0 * covmean))
    return max(value, 0.0)
