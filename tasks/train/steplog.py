"""What each optimizer step reports, and the process facts it needs (memory, RNG snapshots)."""
from __future__ import annotations

import random
import resource
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image


@dataclass
class StepLog:
    """One optimizer step; `validation` and `checkpoint` are set on the steps that made them."""

    step: int
    loss: float
    lr: float
    grad_norm: float
    seconds: float
    images: int
    data_seconds: float = 0.0
    peak_memory_mb: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)
    validation: dict[str, list[Image.Image]] | None = None
    checkpoint: Path | None = None

    def metrics(self) -> dict[str, float]:
        return {"loss": self.loss, "lr": self.lr, "grad_norm": self.grad_norm, "step_seconds": self.seconds,
                "data_seconds": self.data_seconds, "peak_memory_mb": self.peak_memory_mb,
                "images_per_second": self.images / self.seconds if self.seconds > 0 else 0.0, **self.extra}


Callback = Callable[[StepLog], None]


def peak_memory_mb(device: torch.device) -> float:
    """Peak allocated accelerator memory on a GPU; peak resident set size of the process on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


@dataclass
class RngSnapshot:
    """Every RNG accelerate checkpoints, plus its accumulation counter, at an optimizer-step boundary.

    A checkpoint saved after an exception in the middle of a step restores these first, so it is
    exactly the state after the last completed step.
    """

    python: Any
    numpy: Any
    torch_cpu: torch.Tensor
    cuda: list[torch.Tensor]
    accelerator_step: int

    @classmethod
    def take(cls, accelerator: Any) -> RngSnapshot:
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
        return cls(random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda, accelerator.step)

    def restore(self, accelerator: Any) -> None:
        random.setstate(self.python)
        np.random.set_state(self.numpy)
        torch.set_rng_state(self.torch_cpu)
        if self.cuda:
            torch.cuda.set_rng_state_all(self.cuda)
        accelerator.step = self.accelerator_step
