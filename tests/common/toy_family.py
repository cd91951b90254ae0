"""A model family written as one module and nothing else: what a new family must define.

The toy family is SD 1.x's parts under another name, with its own built-in, its own LoRA targets
(the query and value projections only) and a `generate` that records each pipeline call. It is
registered at test time (`families.register(ToyFamily, first=True)`), so detection picks it for a
StableDiffusionPipeline folder while it is registered; no other file of the project knows it.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from tasks.common.families.sd import StableDiffusion

#: every pipeline call made through the toy family: (the pipeline's class, steps, height, width)
CALLS: list[tuple[str, int, Any, Any]] = []


class ToyFamily(StableDiffusion):
    name = "toy"
    title = "Toy (SD 1.x parts)"
    builtin = "builtin:tiny-toy"
    denoiser = replace(StableDiffusion.denoiser, lora_targets=("to_q", "to_v"))

    @classmethod
    def build_tiny(cls, seed: int) -> Any:
        return super().build_tiny(seed + 1000)

    @classmethod
    def generate(cls, pipe: Any, prompts: list[str] | str, *, steps: int, **settings: Any) -> list[Any]:
        CALLS.append((type(pipe).__name__, steps, settings.get("height"), settings.get("width")))
        return super().generate(pipe, prompts, steps=steps, **settings)
