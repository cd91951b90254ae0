"""Generating the evaluation images: fixed seeds, static-shape batches, the same latents for both.

Image j of every prompt starts from the latents drawn from `seed + j`, for the fine-tuned
(OpenVINO) and the base (PyTorch) model alike, so the two grids differ only by the model.

A static OpenVINO export takes exactly `batch_size` prompts and makes `num_images_per_prompt`
images of each per call. The images are planned as units (one prompt, `num_images_per_prompt`
seeds), units are packed `batch_size` per call, and a short last call is padded by repeating
its last unit; padded images are dropped.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from tasks.common import families
from tasks.common.openvino_model import StaticShape

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Unit:
    """One prompt with the seeds of the images one call makes for it (`keep` of them are wanted)."""

    prompt_index: int
    prompt: str
    seeds: tuple[int, ...]
    keep: int


def plan(prompts: list[str], images_per_prompt: int, seed: int, per_prompt_call: int) -> list[Unit]:
    """Units covering `images_per_prompt` images per prompt, `per_prompt_call` seeds per unit."""
    units = []
    for p, prompt in enumerate(prompts):
        for first in range(0, images_per_prompt, per_prompt_call):
            seeds = tuple(seed + first + k for k in range(per_prompt_call))
            units.append(Unit(p, prompt, seeds, min(per_prompt_call, images_per_prompt - first)))
    return units


def batches(units: list[Unit], batch_size: int) -> list[tuple[list[Unit], int]]:
    """Groups of exactly `batch_size` units; each with how many leading units are real."""
    out = []
    for i in range(0, len(units), batch_size):
        chunk = units[i : i + batch_size]
        real = len(chunk)
        chunk = chunk + [chunk[-1]] * (batch_size - real)
        out.append((chunk, real))
    return out


def initial_latents(seeds: list[int], pipe: Any, height: int, width: int) -> Any:
    """Float32 latents (one row per seed, in the family's layout), row i from a CPU generator seeded seeds[i]."""
    import torch

    size = (1, *families.of_pipeline(pipe).denoiser.latent_shape(pipe, height, width))
    rows = [torch.randn(size, generator=torch.Generator().manual_seed(s)) for s in seeds]
    return torch.cat(rows)


def generate(
    pipe: Any,
    prompts: list[str],
    shape: StaticShape,
    images_per_prompt: int,
    seed: int,
    num_inference_steps: int,
    guidance_scale: float,
    desc: str,
    image: list[Any] | None = None,
) -> tuple[list[list[Any]], float]:
    """images[p][j] for every prompt p and image j, and the seconds it took.

    `shape` is the call shape (a static export's, or any shape for a dynamic/PyTorch pipeline);
    `image`: the input images every call edits (a family that makes no image without one).
    """
    pipe.set_progress_bar_config(disable=True)
    family = families.of_pipeline(pipe)
    units = plan(prompts, images_per_prompt, seed, shape.num_images_per_prompt)
    images: list[list[Any]] = [[] for _ in prompts]
    start = time.perf_counter()
    for chunk, real in tqdm(batches(units, shape.batch_size), desc=desc, unit="call", disable=None):
        seeds = [s for unit in chunk for s in unit.seeds]
        out = family.generate(
            pipe, [unit.prompt for unit in chunk], images_per_prompt=shape.num_images_per_prompt,
            latents=initial_latents(seeds, pipe, shape.height, shape.width), height=shape.height,
            width=shape.width, steps=num_inference_steps, guidance=guidance_scale, output_type="pil", image=image)
        per = shape.num_images_per_prompt
        for u, unit in enumerate(chunk[:real]):
            images[unit.prompt_index].extend(out[u * per : u * per + unit.keep])
    seconds = time.perf_counter() - start
    log.info("%s: %d images in %.1f s", desc, sum(map(len, images)), seconds)
    return images, seconds
