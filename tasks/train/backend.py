"""Which back end runs the training loop on this device (the hooks: tasks/train/backend_base.py).

The loop (tasks/train/loop.py) stays the same everywhere; a back end only changes how modules and
optimizer are prepared, how batches reach the device and what happens at the step boundaries:

- XLA (TPU, or a CPU with PJRT_DEVICE=CPU) whenever accelerate runs on torch_xla: tasks/train/xla.py;
- CPU acceleration on a CPU (Intel Extension for PyTorch, or PyTorch's own bf16 autocast):
  tasks/train/cpu_accel.py;
- otherwise (GPUs) the default `Backend`, which only compiles the UNet when `train.torch_compile` asks.

Every back end says in the log what it did, so a run's log shows which path ran.
"""
from __future__ import annotations

import logging
from typing import Any

from tasks.train.backend_base import Backend
from tasks.train.config import TrainConfig

log = logging.getLogger(__name__)


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
