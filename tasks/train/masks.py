"""Masked training (`masked_loss`): which images train masked, and the loss weights of a batch.

The ingest stage writes each image's subject mask (metadata.jsonl `mask_file_name`, 255 = subject);
the data loader gives it the image's crop, flip and bucket resize (tasks/train/data.py
`prepare_mask`) and the latent cache keeps it at the latent's size. Here it becomes per-element
weights on the prediction's grid: families return predictions unpacked ([B, C, h, w]; FLUX's 2x2
tokens are unpacked in `predict`, FLUX.2's patches stay as [B, 4C, h/2, w/2]), so the mask is
area-averaged to that grid, and a latent pixel weighs the share of its pixels that are subject.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from tasks.common.errors import UserError
from tasks.train.diffusion import LossWeights, latent_mask

log = logging.getLogger(__name__)


def check_masks(cfg: Any, instances: list[Any]) -> tuple[bool, float]:
    """(masked, unmasked_probability) for the dataset; masked_loss over images without masks is refused."""
    if not cfg.masked_loss:
        return False, 0.0
    with_mask = sum(r.mask is not None for r in instances)
    if not with_mask:
        raise UserError(
            "train.masked_loss is on, but no instance image has a mask (metadata.jsonl `mask_file_name`). Give "
            "the ingest stage masks (a folder source's mask_dir, <stem>-masklabel.png beside each image, or "
            "ingest.alpha_mask: true for transparent images), or set train.masked_loss: false.")
    if with_mask < len(instances):
        log.warning("masked_loss: %d of %d instance images have no mask; they train unmasked (whole image)",
                    len(instances) - with_mask, len(instances))
    log.info("masked_loss: %d instance images with masks (outside weight %s, unmasked probability %s%s)",
             with_mask, cfg.masked_loss_unmasked_weight, cfg.unmasked_probability,
             ", loss normalised by the masked area" if cfg.normalize_masked_area_loss else "")
    return True, cfg.unmasked_probability


def loss_weights(cfg: Any, masks: list[Any], mask_off: list[bool], pred: torch.Tensor) -> LossWeights | None:
    """Each row's weights on the prediction's latent grid: its mask (a batch's `masks`, None where a
    row has none), `masked_loss_unmasked_weight` outside the subject; 1 everywhere for rows without a
    mask in use (`mask_off`: class images, unmasked draws)."""
    masks = masks or []
    if not cfg.masked_loss or all(m is None or off for m, off in zip(masks, mask_off)):
        return None
    size = tuple(pred.shape[-2:])
    ones = torch.ones(1, *size)
    rows = [ones if m is None or off else latent_mask(m, size) for m, off in zip(masks, mask_off)]
    floor = cfg.masked_loss_unmasked_weight
    weights = floor + (1.0 - floor) * torch.stack(rows)
    return LossWeights(weights.to(pred.device), cfg.normalize_masked_area_loss)
