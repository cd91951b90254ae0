"""The interface between a training method and the shared loop."""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch.utils.data import Dataset

from tasks.train.config import TrainConfig
from tasks.train.models import Components

log = logging.getLogger(__name__)


class TrainingMethod(ABC):
    """What a method decides; the loop owns devices, precision, accumulation, clipping, logging.

    Modules are named as in the diffusers pipeline folder ("unet", "vae", "text_encoder",
    "text_encoder_2"); `trainable()` names those whose weights change. The loop prepares those
    with accelerate and passes the prepared (possibly wrapped) modules back to `compute_loss`.
    """

    name: ClassVar[str]

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self._components: Components | None = None

    @property
    def components(self) -> Components:
        """The base model's parts; bound after the data is checked, so bad inputs fail fast."""
        if self._components is None:
            raise RuntimeError(f"{type(self).__name__}: bind(components) before training")
        return self._components

    def bind(self, components: Components) -> None:
        self._components = components

    # --- what is trained -------------------------------------------------------------------
    @abstractmethod
    def trainable(self) -> list[str]:
        """Names of the modules whose weights this method trains."""

    def configure(self) -> None:
        """Freeze everything, then unfreeze and switch to train mode what `trainable()` names."""
        names = set(self.trainable())
        for name, module in self.components.modules.items():
            module.requires_grad_(name in names)
            module.train(name in names)
        if self.cfg.gradient_checkpointing and "unet" in names:
            self.components.unet.enable_gradient_checkpointing()

    def param_groups(self) -> list[dict[str, Any]]:
        """Optimizer parameter groups (one group with every trainable parameter by default)."""
        params = [p for n in self.trainable() for p in self.components.modules[n].parameters() if p.requires_grad]
        return [{"params": params}]

    # --- data and loss -----------------------------------------------------------------------
    @abstractmethod
    def dataset(self, data_dir: Path, class_dir: Path | None) -> Dataset:
        """The training dataset; raises UserError when inputs are missing."""

    @abstractmethod
    def collate(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        """Batch examples (the DataLoader's collate_fn)."""

    @abstractmethod
    def compute_loss(
        self, batch: dict[str, Any], modules: dict[str, torch.nn.Module]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """(loss to backpropagate, extra scalars to log) for one micro-batch."""

    def images_in(self, batch: dict[str, Any]) -> int:
        """Images one micro-batch pushes through the UNet (for images/s)."""
        return int(batch["pixels"].shape[0])

    # --- output ------------------------------------------------------------------------------
    @abstractmethod
    def save(self, base: Path, out_dir: Path, trained: dict[str, torch.nn.Module]) -> None:
        """Write the method's output to `out_dir`; `trained` are the unwrapped trained modules."""
