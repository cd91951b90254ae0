"""A pipeline whose denoiser is quantized as it loads (`base_model_precision`), the rest in its compute dtype.

The train stage's path (tasks/common/quantize.py): the denoiser's Linear layers are quantized a chunk at
a time as its weights are read, so its full-precision weights are never all in memory; the other parts
of the pipeline load first, without it, in `compute_dtype` (the dtype the denoiser is stored in where
that is bf16 or fp16, read as bf16; else float32). Used by the class_images stage (its class images)
and the evaluate stage (the fine-tune and the base, like with like), which both generate on the base
the train stage held quantized.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tasks.common import families
from tasks.common.quantize import BasePrecision, place_quantized

log = logging.getLogger(__name__)


def compute_dtype(folder: Path) -> Any:
    """bfloat16 when the pipeline in `folder` stores its denoiser in bf16 or fp16, else float32."""
    import torch

    from tasks.common.weights_load import stored_dtype

    family = families.from_index(families.read_index(folder), str(folder))
    stored = stored_dtype(Path(folder) / family.denoiser_name)
    return torch.bfloat16 if stored in (torch.bfloat16, torch.float16) else torch.float32


def place_denoiser(pipe: Any, denoiser: Any) -> None:
    """The loaded denoiser where the pipeline (loaded without it) has its place."""
    object.__setattr__(pipe, families.of_pipeline(pipe).denoiser_name, denoiser)


def load_with_denoiser_last(folder: Path, dtype: Any, device: Any, quantize: BasePrecision | None,
                            extra: dict[str, Any] | None = None,
                            before_denoiser: Callable[[Any, dict[str, Any]], None] | None = None) -> Any:
    """The pipeline of `folder` (any family) on `device` in `dtype`, its denoiser loaded last: with
    `quantize`, its Linear layers quantized as they load (their weights keep their format on `device`).
    `extra`: from_pretrained's other arguments (a safety checker off); `before_denoiser(pipe, index)`
    runs once the rest is loaded and before the denoiser is (class images: encode, release the text
    encoders)."""
    from diffusers import DiffusionPipeline

    index = families.read_index(folder)
    family = families.from_index(index, str(folder))
    pipe = DiffusionPipeline.from_pretrained(folder, dtype=dtype, **(extra or {}),
                                             **{family.denoiser_name: None}).to(device)
    pipe.set_progress_bar_config(disable=True)
    if before_denoiser is not None:
        before_denoiser(pipe, index)
    denoiser = family.load_denoiser(folder, dtype, quantize)
    if quantize is not None:  # a quantized layer's weight keeps its format
        place_quantized(denoiser, device, dtype)
    else:
        denoiser.to(device)
    place_denoiser(pipe, denoiser)
    return pipe
