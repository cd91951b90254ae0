"""One training batch: what data.collate builds and the loss, the caches, the masks and the
families' denoiser call read (rows: the instance images first, then their class images)."""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from tasks.common.families import Geometry, PredictInputs


@dataclass
class ReferenceImages:
    """A batch's reference images, one entry per reference index (a batch has one count: batch_groups):
    the rows' pixels (n, 3, H, W) in [-1, 1], and their latent cache keys (None with random crops)."""

    pixels: list[torch.Tensor]
    keys: list[list[str | None]]

    def to(self, device: Any, non_blocking: bool = False) -> ReferenceImages:
        return ReferenceImages([p.to(device, non_blocking=non_blocking) for p in self.pixels], self.keys)


@dataclass
class Batch:
    #: the decoded rows' pixels (n, 3, H, W) in [-1, 1]; empty when every row came from the disk cache
    pixels: torch.Tensor
    prompts: list[str]
    #: each row's key in the latent cache, and the seed of its noise (the same on any rank)
    latent_keys: list[str]
    noise_seeds: list[int]
    #: where each row came from: source size, crop corner, size trained at ((n, 2) each), which
    #: SDXL's micro-conditioning reads and the latent cache keys a crop by
    geometry: Geometry
    #: how many rows are instance images (the rest are class images, for prior preservation)
    num_instances: int
    #: the concept of each instance row (None outside concepts)
    concepts: list[str | None]
    #: subject masks per row ([1, H, W] at pixel size, or at latent size from the disk cache; None:
    #: none); `mask_off`: the row trains unmasked (class images, unmasked_probability)
    masks: list[Any]
    mask_off: list[bool]
    #: posterior parameters of the rows read from the disk latent cache (None for decoded rows);
    #: None when every row was decoded
    cached_latents: list[Any] | None = None
    #: each row's concept loss weight, only where one is not 1
    loss_weights: torch.Tensor | None = None
    #: token ids per tokenizer (TrainingMethod.collate adds them)
    input_ids: list[torch.Tensor] | None = None
    #: edit training: the rows' reference images per reference index, with their latent cache keys; None
    #: without references (tasks/train/references.py)
    references: ReferenceImages | None = None

    def to(self, device: Any, non_blocking: bool = False) -> Batch:
        """The batch with its tensors on `device` (accelerate's data loader calls this)."""
        return replace(self, **{f.name: _to(getattr(self, f.name), device, non_blocking) for f in fields(self)})

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensor fields by name, the geometry's as `geometry.<field>` (the XLA back end logs them)."""
        named = {f.name: getattr(self, f.name) for f in fields(self)}
        named.update({f"geometry.{f.name}": getattr(self.geometry, f.name) for f in fields(self.geometry)})
        return {k: v for k, v in named.items() if isinstance(v, torch.Tensor)}

    def predict_inputs(self, resolution: int, guidance_scale: float, references: Any = None) -> PredictInputs:
        """What a family's denoiser call reads from this batch and the train settings (`references`:
        the reference images' latents)."""
        return PredictInputs(resolution, guidance_scale, self.geometry, references)


def _to(value: Any, device: Any, non_blocking: bool) -> Any:
    if isinstance(value, (torch.Tensor, Geometry, ReferenceImages)):
        return value.to(device, non_blocking=non_blocking)
    if isinstance(value, list) and any(isinstance(v, torch.Tensor) for v in value):
        return [v.to(device, non_blocking=non_blocking) if isinstance(v, torch.Tensor) else v for v in value]
    return value
