"""EMA of the trained weights (diffusers' EMAModel), optionally kept in CPU memory (seed 003).

`offload_ema` keeps the shadow weights in host RAM: on a GPU run that frees as much accelerator
memory as the trained weights take, at the cost of a device-to-host copy per update, which
`ema_update_every` makes rarer (the training notes update "only every N batches"). The decay then
applies per update. On a CPU run the weights are in host RAM either way.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from tasks.train.config import TrainConfig


class Ema:
    def __init__(self, params: list[torch.nn.Parameter], cfg: TrainConfig) -> None:
        from diffusers.training_utils import EMAModel

        self.params = params
        self.offload = cfg.offload_ema
        self.every = cfg.ema_update_every
        self.model = EMAModel(params, decay=cfg.ema_decay, foreach=not self.offload)
        if self.offload:
            self.model.to("cpu")

    def step(self, step: int) -> None:
        """Update after optimizer step `step` (every `ema_update_every` steps)."""
        if step % self.every:
            return
        params: list[Any] = self.params
        if self.offload and params and params[0].device.type != "cpu":
            # EMAModel skips (copies) tensors that do not require grad: keep the flag on the copies.
            params = [p.detach().to("cpu", non_blocking=True).requires_grad_(p.requires_grad) for p in params]
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        self.model.step(params)

    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The EMA weights in the live parameters for the duration (validation), then the trained ones back."""
        self.model.store(self.params)
        self.model.copy_to(self.params)
        try:
            yield
        finally:
            self.model.restore(self.params)

    def copy_to_params(self) -> None:
        """Make the live parameters the EMA weights (before saving the output)."""
        self.model.copy_to(self.params)

    # accelerate's register_for_checkpointing uses these
    def state_dict(self) -> dict[str, Any]:
        return self.model.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state)
