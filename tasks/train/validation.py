"""Validation images: during training from the live weights, at the end from the saved output.

Fixed seeds (image i of every prompt from seed + i), so images of different steps are comparable.
Generation runs inside `torch.random.fork_rng`: validating never moves the training RNG, so a run
with validation gives the same weights as one without.
"""
from __future__ import annotations

import logging
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from tasks.common import families
from tasks.train.config import TrainConfig
from tasks.train.loop import Validate
from tasks.train.methods.base import TrainingMethod

log = logging.getLogger(__name__)


def generate(pipe: Any, prompts: list[str], cfg: TrainConfig, autocast: Any = None,
             references: list[Path] | None = None) -> dict[str, list[Image.Image]]:
    """`cfg.num_validation_images` images per prompt at the training resolution.

    `autocast` makes a fresh context per prompt (accelerate's `accelerator.autocast`), or None.
    `references`: the first target's reference files, which an edit model's validation images edit
    (FLUX.2 [klein], Kontext, Qwen-Image-Edit on an edit dataset); other images come from the prompt alone.
    """
    if cfg.num_validation_images <= 0 or not prompts:
        return {}
    pipe.set_progress_bar_config(disable=True)
    family = families.of_pipeline(pipe)
    image = _input_images(family, references)
    device = pipe.device
    out: dict[str, list[Image.Image]] = {}
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        for prompt in prompts:
            generators = [torch.Generator("cpu").manual_seed(cfg.seed + i) for i in range(cfg.num_validation_images)]
            with autocast() if autocast is not None else nullcontext():
                out[prompt] = family.generate(
                    pipe, [prompt] * cfg.num_validation_images, height=cfg.resolution, width=cfg.resolution,
                    steps=cfg.validation_inference_steps, generator=generators, image=image)
    return out


def _input_images(family: Any, references: list[Path] | None) -> list[Image.Image] | None:
    """The validation call's input images: an edit model trained on an edit dataset edits the first
    target's references (train refuses a family that needs them on data without: refuse_references)."""
    if not family.inputs.trains or not references:
        return None
    return [Image.open(path).convert("RGB") for path in references]


def live_validator(method: TrainingMethod, base: Path, cfg: TrainConfig, accelerator: Any,
                   prompts: list[str]) -> Validate:
    """Images from the modules being trained (unwrapped), on the main process only."""

    def validate(step: int, modules: dict[str, torch.nn.Module]) -> dict[str, list[Image.Image]]:
        if not accelerator.is_main_process:
            return {}
        unwrapped = {n: accelerator.unwrap_model(m) for n, m in modules.items()}
        training = {n: m.training for n, m in unwrapped.items()}
        pipe = method.live_pipeline(base, unwrapped)
        log.info("validation at step %d: %d image(s) for each of %d prompt(s)", step, cfg.num_validation_images,
                 len(prompts))
        try:
            return generate(pipe, prompts, cfg, accelerator.autocast, method.sample_references)
        finally:
            for name, module in unwrapped.items():
                module.train(training[name])

    return validate


def output_validation(method: TrainingMethod, out_dir: Path, base: Path, cfg: TrainConfig,
                      prompts: list[str]) -> dict[str, list[Image.Image]]:
    """Images from the saved output, loaded the way a user would load it: proof that it loads."""
    if cfg.num_validation_images <= 0:
        return {}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    pipe = method.load_output(out_dir, base).to(device)
    log.info("final validation from %s: %d image(s) for each of %d prompt(s)", out_dir, cfg.num_validation_images,
             len(prompts))
    return generate(pipe, prompts, cfg, references=method.sample_references)
