"""PSNR, the one implementation: the export stage's parity gates and the evaluate stage's export
fidelity both measure how far one image is from another with it.

    psnr_db(a, b, peak) = 10 log10(peak² / MSE(a, b))   in dB, higher is closer

Two values are not PSNRs in the plain sense, because reports are JSON (no infinity, no NaN):

- identical images (MSE 0, PSNR +inf) are recorded at `PSNR_CAP_DB` (100 dB), as is anything closer;
- an image with any non-finite value (NaN, +-inf: a diverged or overflowing model) scores
  `NON_FINITE_DB` (0 dB), the floor of images within [0, peak], whatever the other image holds. So a
  broken output can never pass a threshold: a NaN compared with NaN is not "identical", and NaN is
  never carried into a comparison (where `nan >= limit` and `min(cap, nan)` would silently differ).
  Gates still check finiteness on their own (`finite` in the export report): a threshold of 0 dB or
  less would otherwise let the floor through.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

#: PSNR recorded for identical images (the true value is +inf, which JSON cannot hold).
PSNR_CAP_DB = 100.0
#: PSNR recorded when either image holds a non-finite value (NaN or +-inf).
NON_FINITE_DB = 0.0


def psnr_db(a: Any, b: Any, peak: float = 1.0) -> float:
    """Peak signal-to-noise ratio (dB) of two images of one shape with values in [0, peak]
    (`peak` 1.0 for float images, 255.0 for 8-bit ones; a PIL image is read as its array).

    Capped at PSNR_CAP_DB; NON_FINITE_DB when either image is not finite everywhere."""
    x = np.asarray(a, dtype=np.float64)
    y = np.asarray(b, dtype=np.float64)
    if x.shape != y.shape:
        raise ValueError(f"PSNR needs images of one shape, got {x.shape} and {y.shape}")
    if not (np.isfinite(x).all() and np.isfinite(y).all()):
        return NON_FINITE_DB
    mse = float(np.mean((x - y) ** 2))
    if not math.isfinite(mse):  # finite inputs far outside [0, peak] can still overflow
        return NON_FINITE_DB
    if mse == 0.0:
        return PSNR_CAP_DB
    return min(PSNR_CAP_DB, 10.0 * math.log10(peak**2 / mse))
