"""The base model's parts for training, through its family (tasks/common/families/).

The family says how a prompt becomes conditioning and how the denoiser is called; this module
loads the parts and rebuilds a pipeline around live modules for validation images and saving.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from tasks.common import families
from tasks.common.families import Components

__all__ = ["Components", "load_components", "pipeline_from_modules"]


def load_components(base: Path, prediction_type: str | None = None, denoiser: bool = True,
                    text_quantize: Any = None) -> Components:
    """Every part of a base folder; the noise scheduler is the family's training schedule.
    `denoiser=False`: the denoiser's weights wait for `Components.load_denoiser`; `text_quantize`:
    the text encoders quantized as they load (train.text_encoder_precision)."""
    base = Path(base)
    return families.detect(base).load_components(base, prediction_type, denoiser, text_quantize)  # detect checks


def pipeline_from_modules(
    base: Path, components: Components, modules: dict[str, Any], keep_safety_checker: bool = False
) -> Any:
    """A diffusers pipeline over live (possibly training) modules: the base supplies the rest.

    Used for validation images during training and for saving: nothing is loaded twice, and the
    tokenizers are the (possibly extended) ones being trained with.
    """
    from diffusers import DiffusionPipeline

    parts: dict[str, Any] = dict(modules)
    parts.update(zip(components.family.text.tokenizer_names, components.tokenizers))
    index = families.read_index(base)
    if "safety_checker" in index and not keep_safety_checker:
        # An SD 1.x base may carry a safety checker; validation images do not need it.
        parts.update(safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    return DiffusionPipeline.from_pretrained(base, **parts)
