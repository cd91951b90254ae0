"""Export fidelity: the OpenVINO export's images against the PyTorch fine-tune's, seed by seed.

Both start from the same latents, so any difference is the export's (conversion, precision,
weight compression). Reported apart from the fine-tuning gains: PSNR per image (8-bit, dB;
tasks/common/psnr.py: identical images are recorded at the 100 dB cap, as JSON has no infinity)
and the export's CLIP-T / CLIP-I / DINO beside the PyTorch fine-tune's on the same prompts.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from PIL import Image

from tasks.common.psnr import psnr_db
from tasks.common.scoring import IMAGE_METRICS


def section(export: list[list[Image.Image]], pytorch: list[list[Image.Image]],
            export_scores: dict[str, float], pytorch_scores: dict[str, float],
            precision: dict[str, str], backend: str) -> dict[str, Any]:
    """The report's `export_fidelity` section for images[p][j] of both (same prompts, seeds)."""
    pairs = [(e, t) for erow, trow in zip(export, pytorch, strict=True)
             for e, t in zip(erow, trow, strict=True)]
    values = [psnr_db(e.convert("RGB"), t.convert("RGB"), peak=255.0) for e, t in pairs]
    max_diff = max(int(np.abs(np.asarray(e, np.int16) - np.asarray(t, np.int16)).max())
                   for e, t in pairs)
    out: dict[str, Any] = {
        "backend": backend,
        "precision": precision,
        "prompts": len(export),
        "images": len(pairs),
        "psnr_mean": round(float(np.mean(values)), 4),
        "psnr_min": round(float(np.min(values)), 4),
        "max_abs_pixel_diff": max_diff,
    }
    for name in IMAGE_METRICS:
        out[name] = round(export_scores[name], 6)
        out[f"pytorch_{name}"] = round(pytorch_scores[name], 6)
        out[f"delta_{name}"] = round(export_scores[name] - pytorch_scores[name], 6)
    return out
