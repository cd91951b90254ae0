"""Parity and latency: the same prompt, seed and initial latents through PyTorch and OpenVINO.

A conversion bug (wrong weights, a mis-traced op) shows up as images that differ; fp32 OpenVINO
against fp32 PyTorch agrees to ~50 dB PSNR on the tiny models, so a threshold of 30 dB separates
numerical noise from a broken export. The same two runs give a first latency figure for one call
at the exported static shape (OpenVINO timed on its second call, after the first-inference set-up).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tasks.common import families
from tasks.common.openvino_model import StaticShape
from tasks.common.psnr import psnr_db
from tasks.export.config import ParityConfig

log = logging.getLogger(__name__)

def _max_abs(a: np.ndarray, b: np.ndarray) -> float | None:
    """Largest elementwise difference; None when either side is not finite (JSON has no NaN)."""
    diff = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max()
    return float(diff) if np.isfinite(diff) else None


@dataclass
class Reference:
    """What the parity run used and produced, so other variants can be run and compared alike."""

    latents: Any  # torch.Tensor: the shared initial latents
    call: dict[str, Any]  # ModelFamily.generate's arguments (prompts, size, steps, guidance)
    pytorch_images: np.ndarray
    openvino_images: np.ndarray  # fp32, static shapes


def _step_capture(store: list[np.ndarray]) -> Any:
    """callback_on_step_end that keeps the latents after the first denoising step."""

    def callback(pipe: Any, step: int, timestep: Any, tensors: dict[str, Any]) -> dict[str, Any]:
        if step == 0:
            store.append(tensors["latents"].detach().cpu().numpy().copy())
        return tensors

    return callback


@dataclass
class PyTorchRun:
    """The PyTorch (diffusers, fp32) half of the parity check, run before any OpenVINO model is
    loaded so that the two pipelines are never in memory together (SD 1.5: 4.3 GB + 8 GB)."""

    latents: Any  # torch.Tensor: the shared initial latents
    call: dict[str, Any]
    images: np.ndarray
    step1_latents: np.ndarray
    seconds: float


def pytorch_run(src: Path, shape: StaticShape, cfg: ParityConfig) -> PyTorchRun:
    """Generate once with the diffusers pipeline `src` in fp32 from seeded latents."""
    import torch
    from diffusers import DiffusionPipeline

    return pytorch_call(DiffusionPipeline.from_pretrained(src, dtype=torch.float32), shape, cfg)


def pytorch_call(pt_pipe: Any, shape: StaticShape, cfg: ParityConfig) -> PyTorchRun:
    """pytorch_run's call on a loaded diffusers pipeline (fp32; a LoRA may be loaded, unfused)."""
    import torch

    pt_pipe.set_progress_bar_config(disable=True)
    generator = torch.Generator().manual_seed(cfg.seed)
    family = families.of_pipeline(pt_pipe)
    size = (shape.images_per_call, *family.denoiser.latent_shape(pt_pipe, shape.height, shape.width))
    latents = torch.randn(size, generator=generator)
    call = dict(prompts=[cfg.prompt] * shape.batch_size, images_per_prompt=shape.num_images_per_prompt,
                height=shape.height, width=shape.width, steps=cfg.num_inference_steps,
                guidance=cfg.guidance_scale, output_type="np")
    step: list[np.ndarray] = []
    log.info("parity: %d steps through PyTorch", cfg.num_inference_steps)
    start = time.perf_counter()
    images = family.generate(pt_pipe, latents=latents.clone(), callback=_step_capture(step), **call)
    return PyTorchRun(latents, call, images, step[0], time.perf_counter() - start)


def run_parity(
    pt: PyTorchRun, ov_pipe: Any, cfg: ParityConfig
) -> tuple[dict[str, Any], dict[str, Any], Reference]:
    """The OpenVINO half: the same call as `pt` through `ov_pipe`, and the comparison.

    Returns (parity, latency) sections of the export report and the Reference (latents, call
    arguments, both images) for comparing other variants. `parity.passed` is False when the
    image PSNR is below `cfg.min_psnr_db` (or any output is not finite).
    """
    ov_pipe.set_progress_bar_config(disable=True)
    ov_step: list[np.ndarray] = []
    log.info("parity: %d steps through OpenVINO", cfg.num_inference_steps)
    start = time.perf_counter()
    family = families.of_pipeline(ov_pipe)
    ov_images = family.generate(ov_pipe, latents=pt.latents.clone(), callback=_step_capture(ov_step), **pt.call)
    ov_first_s = time.perf_counter() - start
    start = time.perf_counter()
    family.generate(ov_pipe, latents=pt.latents.clone(), **pt.call)
    ov_s = time.perf_counter() - start
    ov_pipe.set_progress_bar_config(disable=False)
    pt_images = pt.images
    parity = parity_section(pt_images, ov_images, cfg)
    parity["step1_latents_max_abs_diff"] = _max_abs(pt.step1_latents, ov_step[0])
    latency = {
        "images_per_call": int(pt.latents.shape[0]),
        "num_inference_steps": cfg.num_inference_steps,
        "pytorch_eager": round(pt.seconds, 4),
        "openvino_static_first_call": round(ov_first_s, 4),
        "openvino_static": round(ov_s, 4),
    }
    log.info("parity: PSNR %.1f dB (%s); latency of one call: PyTorch %.2f s, OpenVINO %.2f s",
             parity["image_psnr_db"], "ok" if parity["passed"] else "FAILED", pt.seconds, ov_s)
    return parity, latency, Reference(pt.latents, pt.call, pt_images, ov_images)


def parity_section(pt_images: np.ndarray, ov_images: np.ndarray, cfg: ParityConfig) -> dict[str, Any]:
    """The report's parity section for two image batches in [0, 1]; `passed` is False when the
    PSNR is below `cfg.min_psnr_db` or any output is not finite."""
    psnr = psnr_db(pt_images, ov_images)
    finite = bool(np.isfinite(ov_images).all() and np.isfinite(pt_images).all())
    return {
        "enabled": True,
        "prompt": cfg.prompt,
        "num_inference_steps": cfg.num_inference_steps,
        "seed": cfg.seed,
        "image_psnr_db": round(psnr, 3),
        "image_max_abs_diff": _max_abs(pt_images, ov_images),
        "finite": finite,
        "min_psnr_db": cfg.min_psnr_db,
        "passed": finite and (cfg.min_psnr_db is None or psnr >= cfg.min_psnr_db),
    }
