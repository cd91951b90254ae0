"""A pipeline whose denoiser is quantized as it loads (`base_model_precision`), the rest in its compute dtype.

The train stage's path (tasks/common/quantize.py): the denoiser's Linear layers are quantized a chunk at
a time as its weights are read, so its full-precision weights are never all in memory; the other parts
of the pipeline load first, without it, in `compute_dtype` (bf16 where the denoiser is stored in bf16
or fp16 and the CPU computes bf16 natively, else float32: finetune_runtime/cpu_formats.py). Used by
the class_images stage (its class images) and the evaluate stage (the fine-tune and the base, like
with like), which both generate on the base the train stage held quantized.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from finetune_runtime import cpu_formats
from tasks.common import families
from tasks.common.quantize import BasePrecision, place_quantized

log = logging.getLogger(__name__)


def compute_dtype(folder: Path, device_type: str = "cpu") -> Any:
    """bfloat16 when the pipeline in `folder` stores its denoiser in bf16 or fp16 and `device_type`
    computes bf16 natively (a GPU, or a CPU with AVX512-BF16 or AMX-BF16: finetune_runtime/cpu_formats.py),
    else float32 (an AVX2-only CPU would emulate bf16, ~500x slower)."""
    return compute_choice(folder, device_type)[0]


def compute_choice(folder: Path, device_type: str = "cpu") -> tuple[Any, str]:
    """(`compute_dtype`, why: the stored dtype and, on a CPU, its native formats), for the log line."""
    import torch

    from tasks.common.weights_load import stored_dtype

    family = families.from_index(families.read_index(folder), str(folder))
    stored = stored_dtype(Path(folder) / family.denoiser.name)
    dtype = cpu_formats.compute_dtype(stored, device_type=device_type)
    name = str(stored).removeprefix("torch.") if stored is not None else "no safetensors"
    if stored not in (torch.bfloat16, torch.float16):
        return dtype, f"the base's {family.denoiser.name} is stored in {name}"
    if device_type != "cpu":
        return dtype, f"the base's {family.denoiser.name} is stored in {name}, on {device_type}"
    choice = cpu_formats.auto_bf16(key=f"the base's {family.denoiser.name} is stored in {name}")
    return dtype, choice.why


def place_denoiser(pipe: Any, denoiser: Any) -> None:
    """The loaded denoiser where the pipeline (loaded without it) has its place."""
    object.__setattr__(pipe, families.of_pipeline(pipe).denoiser.name, denoiser)


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
                                             **{family.denoiser.name: None}).to(device)
    pipe.set_progress_bar_config(disable=True)
    if before_denoiser is not None:
        before_denoiser(pipe, index)
    denoiser = family.denoiser.load(folder, dtype, quantize)
    if quantize is not None:  # a quantized layer's weight keeps its format
        place_quantized(denoiser, device, dtype)
    else:
        denoiser.to(device)
    place_denoiser(pipe, denoiser)
    return pipe
