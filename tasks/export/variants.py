"""The other OpenVINO variants timed and compared on the parity run's exact call.

Issue 6 asks for four latencies on the same machine, prompt, steps and latents: PyTorch eager
fp32 comes from the parity run (as does OpenVINO static at f32, the conversion check); this adds
OpenVINO static at the deployment precision (`export.inference_precision`), with dynamic shapes
(the same IR loaded the way optimum-intel loads it by default) and the compressed pipeline, each
with its images' PSNR against fp32 OpenVINO and against PyTorch. Each OpenVINO figure is its
second call (the first pays one-off set-up).
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import numpy as np

from tasks.common import families
from tasks.common.openvino_model import compiled_precisions, load_ov_pipeline
from tasks.common.psnr import psnr_db
from tasks.export.parity import Reference

log = logging.getLogger(__name__)


def timed_call(pipe: Any, ref: Reference) -> tuple[float, np.ndarray]:
    """(seconds of the second call, images) of `pipe` on the reference call."""
    pipe.set_progress_bar_config(disable=True)
    family = families.of_pipeline(pipe)
    images = family.generate(pipe, latents=ref.latents.clone(), **ref.call)
    start = time.perf_counter()
    family.generate(pipe, latents=ref.latents.clone(), **ref.call)
    seconds = time.perf_counter() - start
    pipe.set_progress_bar_config(disable=False)
    return seconds, images


def dynamic_latency(fp32_dir: Path, ref: Reference, precision: str) -> float:
    """Seconds per call of the fp32 export loaded with dynamic shapes, at `precision`."""
    pipe = load_ov_pipeline(fp32_dir, static=False, precision=precision)
    seconds, images = timed_call(pipe, ref)
    log.info("OpenVINO dynamic shapes: %.2f s per call (PSNR vs static f32 %.1f dB)",
             seconds, psnr_db(images, ref.openvino_images))
    return seconds


def compare(pipe: Any, ref: Reference, label: str) -> tuple[float, dict[str, Any]]:
    """(seconds per call, fidelity) of a static pipeline against the parity run's images."""
    seconds, images = timed_call(pipe, ref)
    fidelity = {
        "psnr_vs_openvino_fp32_db": round(psnr_db(images, ref.openvino_images), 3),
        "psnr_vs_pytorch_fp32_db": round(psnr_db(images, ref.pytorch_images), 3),
        "finite": bool(np.isfinite(images).all()),
        "compiled_precision": compiled_precisions(pipe),
    }
    log.info("OpenVINO %s: %.2f s per call, PSNR vs fp32 %.1f dB, compiled as %s", label,
             seconds, fidelity["psnr_vs_openvino_fp32_db"], fidelity["compiled_precision"])
    return seconds, fidelity


def add_ratios(latency: dict[str, Any]) -> None:
    """Speed-ups over PyTorch eager for every OpenVINO figure present (in place)."""
    eager = latency.get("pytorch_eager")
    for key in ("openvino_dynamic", "openvino_static_f32", "openvino_static",
                "openvino_compressed"):
        value = latency.get(key)
        if eager and value:
            latency[f"speedup_{key.removeprefix('openvino_')}_vs_eager"] = round(eager / value, 3)
