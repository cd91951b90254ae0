"""Optimizer, LR schedule and precision choices, by diffusers' option names."""
from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from tasks.train.config import TrainConfig

log = logging.getLogger(__name__)


def weight_dtype(mixed_precision: str) -> torch.dtype:
    """dtype for frozen weights: they only run forward, so they can be stored in the low precision."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision, torch.float32)


def make_optimizer(cfg: TrainConfig, groups: list[dict[str, Any]], lr: float) -> torch.optim.Optimizer:
    """`train.optimizer` over `groups` (tasks/train/README.md, "Optimizers"): AdamW with torch's fused
    kernel, bitsandbytes' AdamW8bit, Prodigy, torch's Adafactor, schedule-free AdamW or Lion; AdamW
    with stochastic rounding for weights held in bf16 (`full_bf16`).

    The fused kernel updates each parameter in one pass instead of several: on this CPU a step over
    SD 1.5's 860M UNet weights takes about 2.5 s instead of about 25 s (benchmarks/train/README.md).
    The seeds' scripts use the default (per-parameter loop) implementation.
    """
    adam: dict[str, Any] = dict(lr=lr, betas=(cfg.adam_beta1, cfg.adam_beta2), weight_decay=cfg.adam_weight_decay,
                                eps=cfg.adam_epsilon)
    name = optimizer_name(cfg, [p for g in groups for p in g["params"]])
    if name in _BUILDERS:
        return _BUILDERS[name](cfg, groups, adam)
    try:
        return torch.optim.AdamW(groups, fused=True, **adam)
    except (RuntimeError, TypeError, ValueError) as err:  # a device or dtype without the fused kernel
        log.info("fused AdamW unavailable (%s); using the default implementation", err)
        return torch.optim.AdamW(groups, **adam)


def _adamw8bit(cfg: TrainConfig, groups: list[dict[str, Any]], adam: dict[str, Any]) -> torch.optim.Optimizer:
    import bitsandbytes as bnb  # checked at config load

    return bnb.optim.AdamW8bit(groups, **adam)


def _stochastic_adamw(cfg: TrainConfig, groups: list[dict[str, Any]], adam: dict[str, Any]) -> torch.optim.Optimizer:
    from tasks.train.bf16_adamw import StochasticAdamW

    return StochasticAdamW(groups, **adam)


def _prodigy(cfg: TrainConfig, groups: list[dict[str, Any]], adam: dict[str, Any]) -> torch.optim.Optimizer:
    """As diffusers' scripts build it (`--optimizer prodigy`); `learning_rate` multiplies its estimate."""
    import prodigyopt

    if adam["lr"] < 0.1:
        log.warning("optimizer prodigy with learning_rate %g: Prodigy estimates the step size itself and the "
                    "learning rate multiplies it; 1.0 is the usual setting", adam["lr"])
    return prodigyopt.Prodigy(groups, **adam, beta3=cfg.prodigy_beta3, decouple=cfg.prodigy_decouple,
                              use_bias_correction=cfg.prodigy_use_bias_correction,
                              safeguard_warmup=cfg.prodigy_safeguard_warmup)


def _adafactor(cfg: TrainConfig, groups: list[dict[str, Any]], adam: dict[str, Any]) -> torch.optim.Optimizer:
    """torch's Adafactor: factored second moments, no first moment; the step is relative to each
    tensor's RMS (tasks/train/README.md, "Optimizers", says why torch's and not transformers')."""
    return torch.optim.Adafactor(groups, lr=adam["lr"], weight_decay=adam["weight_decay"], foreach=True)


def _schedulefree_adamw(cfg: TrainConfig, groups: list[dict[str, Any]], adam: dict[str, Any]) -> torch.optim.Optimizer:
    import schedulefree

    return schedulefree.AdamWScheduleFree(groups, **adam)


def _lion(cfg: TrainConfig, groups: list[dict[str, Any]], adam: dict[str, Any]) -> torch.optim.Optimizer:
    from lion_pytorch import Lion

    return Lion(groups, lr=adam["lr"], betas=adam["betas"], weight_decay=adam["weight_decay"])


_BUILDERS = {"adamw8bit": _adamw8bit, "adamw_bf16_stochastic": _stochastic_adamw, "prodigy": _prodigy,
             "adafactor": _adafactor, "schedulefree_adamw": _schedulefree_adamw, "lion": _lion}


def optimizer_name(cfg: TrainConfig, params: list[torch.Tensor]) -> str:
    """The optimizer make_optimizer builds for `params` (the trainable tensors), by the name
    reports/train.json gives it: `train.optimizer` (adamw8bit also by `use_8bit_adam`), or
    adamw_bf16_stochastic for adamw over weights held in bf16 (`full_bf16`, the method placed them so)."""
    name = cfg.optimizer_choice
    if name == "adamw" and params and all(p.dtype == torch.bfloat16 for p in params):
        return "adamw_bf16_stochastic"
    return name


def set_training(optimizer: Any, training: bool) -> None:
    """Schedule-free optimizers hold the weights at their training point in train mode and at their
    average in eval mode: switch (accelerate's wrapper passes it on); the others have no modes."""
    inner = getattr(optimizer, "optimizer", optimizer)
    if callable(getattr(inner, "train", None)) and callable(getattr(inner, "eval", None)):
        inner.train() if training else inner.eval()


@contextmanager
def evaluating(optimizer: Any) -> Iterator[None]:
    """The weights to validate or save (schedule-free: the average) for the block, then training's again."""
    set_training(optimizer, False)
    try:
        yield
    finally:
        set_training(optimizer, True)


def make_lr_scheduler(cfg: TrainConfig, optimizer: torch.optim.Optimizer, num_processes: int) -> Any:
    """diffusers' get_scheduler; accelerate steps a prepared scheduler once per process, hence the scaling."""
    from diffusers.optimization import get_scheduler

    return get_scheduler(
        cfg.lr_scheduler, optimizer, num_warmup_steps=cfg.lr_warmup_steps * num_processes,
        num_training_steps=cfg.max_train_steps * num_processes, num_cycles=cfg.lr_num_cycles, power=cfg.lr_power,
    )
