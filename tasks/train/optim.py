"""Optimizer, LR schedule and precision choices, by diffusers' option names."""
from __future__ import annotations

import logging
from typing import Any

import torch

from tasks.train.config import TrainConfig

log = logging.getLogger(__name__)


def weight_dtype(mixed_precision: str) -> torch.dtype:
    """dtype for frozen weights: they only run forward, so they can be stored in the low precision."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision, torch.float32)


def make_optimizer(cfg: TrainConfig, groups: list[dict[str, Any]], lr: float) -> torch.optim.Optimizer:
    """AdamW with torch's fused kernel, bitsandbytes' AdamW8bit with `use_8bit_adam`, or AdamW with
    stochastic rounding for weights held in bf16 (`full_bf16`).

    The fused kernel updates each parameter in one pass instead of several: on this CPU a step over
    SD 1.5's 860M UNet weights takes about 2.5 s instead of about 25 s (benchmarks/train/README.md).
    The seeds' scripts use the default (per-parameter loop) implementation.
    """
    kwargs: dict[str, Any] = dict(lr=lr, betas=(cfg.adam_beta1, cfg.adam_beta2), weight_decay=cfg.adam_weight_decay,
                                  eps=cfg.adam_epsilon)
    name = optimizer_name(cfg, [p for g in groups for p in g["params"]])
    if name == "adamw8bit":
        import bitsandbytes as bnb  # checked at config load

        return bnb.optim.AdamW8bit(groups, **kwargs)
    if name == "adamw_bf16_stochastic":
        from tasks.train.bf16_adamw import StochasticAdamW

        return StochasticAdamW(groups, **kwargs)
    try:
        return torch.optim.AdamW(groups, fused=True, **kwargs)
    except (RuntimeError, TypeError, ValueError) as err:  # a device or dtype without the fused kernel
        log.info("fused AdamW unavailable (%s); using the default implementation", err)
        return torch.optim.AdamW(groups, **kwargs)


def optimizer_name(cfg: TrainConfig, params: list[torch.Tensor]) -> str:
    """The optimizer make_optimizer builds for `params` (the trainable tensors), by the name
    reports/train.json gives it: adamw8bit (`use_8bit_adam`), adamw_bf16_stochastic (weights held in
    bf16: `full_bf16`, the method placed them so) or adamw."""
    if cfg.use_8bit_adam:
        return "adamw8bit"
    if params and all(p.dtype == torch.bfloat16 for p in params):
        return "adamw_bf16_stochastic"
    return "adamw"


def make_lr_scheduler(cfg: TrainConfig, optimizer: torch.optim.Optimizer, num_processes: int) -> Any:
    """diffusers' get_scheduler; accelerate steps a prepared scheduler once per process, hence the scaling."""
    from diffusers.optimization import get_scheduler

    return get_scheduler(
        cfg.lr_scheduler, optimizer, num_warmup_steps=cfg.lr_warmup_steps * num_processes,
        num_training_steps=cfg.max_train_steps * num_processes, num_cycles=cfg.lr_num_cycles, power=cfg.lr_power,
    )
