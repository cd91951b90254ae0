"""The size of the images a pipeline call makes: one rule, for every stage and the served model.

`shape_of` reads what a loaded pipeline makes by default (once, at load); `output_size` decides a
call's (height, width) from what was asked, the call's first input image and that shape. Every call
(pipeline_call.generate) passes the size it decides, so the pipeline's own default never decides
anything the served model's budget did not count.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from finetune_runtime.convention import CallConvention

#: The size a pipeline that says nothing of its own makes (SD 1.x's).
FALLBACK_SIDE = 512
#: An input image's smallest side after scaling, and the smallest edit made from one.
MIN_SIDE = 64


class SizeError(ValueError):
    """A size that cannot be made; the message names the field (`image[0]`) and the fix."""


@dataclass(frozen=True)
class Shape:
    """What a loaded pipeline makes: `default` (height, width) with nothing asked, only that size when
    `static` (a pipeline with a fixed `height` and `width`: a static-shape OpenVINO export, GenAI's
    pipelines compiled at one size), a side a multiple of `multiple`."""

    default: tuple[int, int]
    static: bool = False
    multiple: int = 8


def _sample_size(module: Any) -> Any:
    config = getattr(module, "config", None) or {}
    return config.get("sample_size") if isinstance(config, dict) else getattr(config, "sample_size", None)


def _default_side(pipe: Any, convention: CallConvention) -> int:
    """The denoiser's sample size (`default_sample_size` for SDXL, SD3, FLUX; the convention's where the
    pipeline hard-codes it) times the VAE's factor; FALLBACK_SIDE when none is known."""
    sample = convention.default_sample_size or getattr(pipe, "default_sample_size", None)
    if sample is None:  # the denoiser: the one component besides the VAE's whose config has a sample size
        components = getattr(pipe, "components", None) or {}
        sizes = [_sample_size(module) for name, module in components.items() if not name.startswith("vae")]
        sample = next((size for size in sizes if size is not None), None)
    if isinstance(sample, (list, tuple)):
        sample = sample[0]
    if not isinstance(sample, int) or sample <= 0:
        return FALLBACK_SIDE
    return sample * int(getattr(pipe, "vae_scale_factor", 8))


def shape_of(pipe: Any, convention: CallConvention, exported: tuple[int, int] | None = None) -> Shape:
    """What `pipe` makes. `exported`: the size a dynamic-shape OpenVINO export was saved at, its
    default (optimum-intel's dynamic load forgets it and would use the denoiser's sample size)."""
    multiple = int(getattr(pipe, "vae_scale_factor", None) or getattr(pipe, "vae_spatial_compression_ratio", 8))
    height, width = getattr(pipe, "height", -1), getattr(pipe, "width", -1)
    if isinstance(height, int) and isinstance(width, int) and height > 0 and width > 0:
        return Shape((height, width), True, multiple)
    if exported:
        return Shape(exported, False, multiple)
    side = _default_side(pipe, convention)
    return Shape((side, side), False, multiple)


def encoded_size(size: tuple[int, int], max_pixels: int | None) -> tuple[int, int]:
    """(width, height) an input image of `size` (width, height) is scaled to before it is encoded (at
    most `max_pixels`; None: not scaled)."""
    width, height = size
    scale = min(1.0, math.sqrt(max_pixels / (width * height))) if max_pixels else 1.0
    return int(width * scale), int(height * scale)


def edit_size(image_size: tuple[int, int], multiple: int, max_pixels: int | None, max_side: int | None
              ) -> tuple[int, int]:
    """(height, width) of an edit made at an input image's size (width, height), as the pipeline makes
    it: scaled to at most `max_pixels` (and, as the served model's limit, `max_side`), floored to
    `multiple`."""
    width, height = encoded_size(image_size, max_pixels)
    scale = min(1.0, max_side / max(width, height)) if max_side else 1.0
    return int(height * scale) // multiple * multiple, int(width * scale) // multiple * multiple


def output_size(shape: Shape, convention: CallConvention, height: int | None = None, width: int | None = None,
                image_size: tuple[int, int] | None = None, max_side: int | None = None) -> tuple[int, int]:
    """(height, width) of a call: a static pipeline's own size whatever was asked; else what was asked,
    each side not asked taken from the first input image's size (`image_size`, width x height, an
    edit: see `edit_size`, at most `max_side`) or, without one, the pipeline's default."""
    if shape.static:
        return shape.default
    if height is not None and width is not None:
        return height, width
    if image_size is None:
        return height or shape.default[0], width or shape.default[1]
    edit = edit_size(image_size, shape.multiple * convention.latent_patch, convention.edit_pixels, max_side)
    out = (height or edit[0], width or edit[1])
    if short := [f"{name} {side}" for name, side, asked in (("height", out[0], height), ("width", out[1], width))
                 if asked is None and side < MIN_SIDE]:
        raise SizeError(f"image[0]: {image_size[0]}x{image_size[1]} px would make an edit of {', '.join(short)} px; "
                        f"pass {' and '.join(s.split()[0] for s in short)} (at least {MIN_SIDE})")
    return out
