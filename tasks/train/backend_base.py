"""The hooks the one training loop calls so that it runs fast on each kind of device, and their default.

`Backend` is the default (GPUs: PyTorch as is, the UNet compiled when `train.torch_compile` asks)
and the base of the other back ends (tasks/train/cpu_accel.py, tasks/train/xla.py). Which one runs
is chosen in tasks/train/backend.py, which imports them all: this module imports none of them.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch

from tasks.train.config import TrainConfig

log = logging.getLogger(__name__)


class Backend:
    """Default: PyTorch as is, plus `torch.compile` of the UNet on request."""

    name = "default"

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg

    def prepare(self, method: Any, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The method's modules and the optimizer, before accelerate prepares them; returns the
        optimizer to use (the loop reads the trained parameters back from it)."""
        self.compile(method.components.denoiser)
        return optimizer

    def compile(self, denoiser: torch.nn.Module) -> None:
        # nn.Module.compile() compiles in place: the module, its parameters and state_dict keys stay
        # the same objects, so checkpoints, EMA and saving need no unwrapping.
        if self.cfg.torch_compile:
            denoiser.compile()
            log.info("torch.compile: denoiser compiled (the first steps include the compilation)")

    def loader(self, loader: Iterable[Any]) -> Iterable[Any]:
        """The batches of one epoch, on the device."""
        return loader

    def after_backward(self) -> None:
        """Loss and gradients are about to be read (eager back ends: nothing to do)."""

    def after_step(self, step: int) -> None:
        """After each optimizer step (`step` counts completed steps)."""

    def finish(self, trained: dict[str, torch.nn.Module]) -> None:
        """After the last step, before the trained modules are saved."""

    def close(self) -> None:
        """End of the loop, also on errors."""
