"""Validation images from a saved pipeline folder: proof that it loads, and a look at the result."""
from __future__ import annotations

import logging
from pathlib import Path

from PIL import Image

log = logging.getLogger(__name__)


def validation_images(
    pipeline_dir: Path, prompt: str, num_images: int, resolution: int, steps: int, seed: int
) -> list[Image.Image]:
    """`num_images` images of `prompt`, image i from a CPU generator seeded with seed + i."""
    import torch
    from diffusers import DiffusionPipeline

    if num_images <= 0:
        return []
    device = "cuda" if torch.cuda.is_available() else "cpu"
    pipe = DiffusionPipeline.from_pretrained(pipeline_dir).to(device)
    pipe.set_progress_bar_config(disable=True)
    generators = [torch.Generator("cpu").manual_seed(seed + i) for i in range(num_images)]
    log.info("validation: %d images of %r from %s", num_images, prompt, pipeline_dir)
    return pipe(
        prompt=[prompt] * num_images, height=resolution, width=resolution,
        num_inference_steps=steps, generator=generators,
    ).images
