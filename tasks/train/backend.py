"""The hooks the one training loop calls so that it runs fast on each kind of device.

The loop (tasks/train/loop.py) stays the same everywhere; a back end only changes how modules and
optimizer are prepared, how batches reach the device and what happens at the step boundaries:

- XLA (TPU, or a CPU with PJRT_DEVICE=CPU) whenever accelerate runs on torch_xla: tasks/train/xla.py;
- CPU acceleration on a CPU (Intel Extension for PyTorch, or PyTorch's own bf16 autocast):
  tasks/train/cpu_accel.py;
- otherwise (GPUs) this default, which only compiles the UNet when `train.torch_compile` asks.

Every back end says in the log what it did, so a run's log shows which path ran.
"""
from __future__ import annotations

import logging
from typing import Any, Iterable

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


def caches_on_host(accelerator: Any) -> bool:
    """False where the back end switches the latent and text caches off (XLA: XlaBackend.prepare)."""
    from accelerate.utils import DistributedType

    return accelerator.distributed_type != DistributedType.XLA


def choose_backend(cfg: TrainConfig, accelerator: Any) -> Backend:
    """XLA when accelerate runs on torch_xla, CPU acceleration on a CPU, else the default."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type == DistributedType.XLA:
        from tasks.train.xla import XlaBackend

        return XlaBackend(cfg, accelerator)
    if accelerator.device.type == "cpu":
        from tasks.train.cpu_accel import choose_cpu_backend

        return choose_cpu_backend(cfg, accelerator.mixed_precision)
    backend = Backend(cfg)
    log.info("back end: %s on %s%s", backend.name, accelerator.device, ", torch.compile" if cfg.torch_compile else "")
    return backend
