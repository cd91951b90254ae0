"""The one training loop every method shares.

Reads top to bottom: build optimizer and LR schedule over the method's parameters, let accelerate
prepare what trains (device, mixed precision, gradient accumulation, and the distributed wrappers
when launched that way), then step until `max_train_steps` optimizer steps, clipping gradients and
reporting each step to callbacks. A non-finite loss stops the run before it poisons the weights.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils.data import DataLoader
from tqdm import tqdm

from tasks.common.errors import UserError
from tasks.train.config import TrainConfig
from tasks.train.methods.base import TrainingMethod

log = logging.getLogger(__name__)


class TrainingDiverged(UserError):
    """The loss became NaN or infinite; the message says at which step and what to change."""


@dataclass
class StepLog:
    """What one optimizer step reports."""

    step: int
    loss: float
    lr: float
    grad_norm: float
    seconds: float
    images: int
    extra: dict[str, float] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        return {"loss": self.loss, "lr": self.lr, "grad_norm": self.grad_norm, "step_seconds": self.seconds,
                "images_per_second": self.images / self.seconds if self.seconds > 0 else 0.0, **self.extra}


Callback = Callable[[StepLog], None]


@dataclass
class LoopResult:
    history: list[StepLog]
    seconds: float
    images: int
    trained: dict[str, torch.nn.Module]  # unwrapped trained modules, for the method's save()


def weight_dtype(mixed_precision: str) -> torch.dtype:
    """dtype for frozen modules: they only run forward, so they can be stored in the low precision."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision, torch.float32)


def make_accelerator(cfg: TrainConfig) -> Any:
    """A fresh accelerate `Accelerator` for this run (CPU or GPU; distributed when launched so).

    accelerate keeps its state in process-wide singletons; resetting the per-run part lets one
    process (a test session) run trainings with different precision settings one after another.
    """
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    return Accelerator(
        mixed_precision=cfg.mixed_precision, gradient_accumulation_steps=cfg.gradient_accumulation_steps
    )


def _place_frozen(method: TrainingMethod, trainable: list[str], device: torch.device, mixed_precision: str) -> None:
    dtype = weight_dtype(mixed_precision)
    for name, module in method.components.modules.items():
        if name in trainable:
            continue
        # fp16 VAEs overflow (SDXL's notably); bf16 has fp32's range.
        target = torch.float32 if name == "vae" and dtype == torch.float16 else dtype
        if target == torch.float32:
            module.to(device)  # already fp32 (passing a dtype makes diffusers warn for nothing)
        else:
            module.to(device, dtype=target)


def run_loop(
    method: TrainingMethod,
    dataloader: DataLoader,
    cfg: TrainConfig,
    accelerator: Any,
    callbacks: list[Callback] = (),  # type: ignore[assignment]
) -> LoopResult:
    """Train for `cfg.max_train_steps` optimizer steps; returns the per-step history."""
    from diffusers.optimization import get_scheduler

    method.configure()
    trainable = method.trainable()
    modules = method.components.modules
    groups = method.param_groups()
    params = [p for g in groups for p in g["params"]]
    optimizer = torch.optim.AdamW(
        groups, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2),
        weight_decay=cfg.adam_weight_decay, eps=cfg.adam_epsilon,
    )
    # accelerate steps a prepared scheduler once per process: scale as diffusers' examples do.
    n_proc = accelerator.num_processes
    lr_scheduler = get_scheduler(
        cfg.lr_scheduler, optimizer, num_warmup_steps=cfg.lr_warmup_steps * n_proc,
        num_training_steps=cfg.max_train_steps * n_proc,
    )
    prepared = accelerator.prepare(*[modules[n] for n in trainable], optimizer, dataloader, lr_scheduler)
    wrapped = dict(zip(trainable, prepared[: len(trainable)]))
    optimizer, dataloader, lr_scheduler = prepared[len(trainable):]
    _place_frozen(method, trainable, accelerator.device, accelerator.mixed_precision)
    live = {**modules, **wrapped}

    n_params = sum(p.numel() for p in params)
    log.info("training %s (%s, %.2fM parameters) for %d steps, batch %d x %d accumulation x %d processes, "
             "precision %s on %s", method.name, ", ".join(trainable), n_params / 1e6, cfg.max_train_steps,
             cfg.train_batch_size, cfg.gradient_accumulation_steps, n_proc, cfg.mixed_precision, accelerator.device)

    history: list[StepLog] = []
    step, total_images, start = 0, 0, time.perf_counter()
    micro_losses: list[torch.Tensor] = []
    extras: dict[str, list[float]] = {}
    step_images, step_start = 0, time.perf_counter()
    bar = tqdm(total=cfg.max_train_steps, desc=f"train {method.name}", unit="step",
               disable=None if accelerator.is_local_main_process else True)
    while step < cfg.max_train_steps:
        for batch in dataloader:
            with accelerator.accumulate(*wrapped.values()):
                with accelerator.autocast():
                    loss, parts = method.compute_loss(batch, live)
                loss_value = float(loss.detach())
                if not math.isfinite(loss_value):
                    raise TrainingDiverged(
                        f"the loss became {loss_value} at step {step + 1} (learning rate "
                        f"{lr_scheduler.get_last_lr()[0]:.3g}). Lower train.learning_rate, raise "
                        "train.lr_warmup_steps, or train with mixed_precision bf16/no instead of fp16."
                    )
                accelerator.backward(loss)
                grad_norm = float("nan")
                if accelerator.sync_gradients:
                    grad_norm = float(accelerator.clip_grad_norm_(params, cfg.max_grad_norm))
                lr = lr_scheduler.get_last_lr()[0]
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            micro_losses.append(loss.detach())
            for key, value in parts.items():
                extras.setdefault(key, []).append(value)
            images = method.images_in(batch) * n_proc
            step_images += images
            total_images += images
            if not accelerator.sync_gradients:
                continue
            step += 1
            mean_loss = accelerator.reduce(torch.stack(micro_losses).mean(), reduction="mean")
            now = time.perf_counter()
            entry = StepLog(step, float(mean_loss), float(lr), grad_norm, now - step_start, step_images,
                            {k: sum(v) / len(v) for k, v in extras.items()})
            history.append(entry)
            for callback in callbacks:
                callback(entry)
            bar.update(1)
            bar.set_postfix(loss=f"{entry.loss:.4f}")
            micro_losses, extras, step_images, step_start = [], {}, 0, time.perf_counter()
            if step >= cfg.max_train_steps:
                break
    bar.close()
    accelerator.wait_for_everyone()
    trained = {n: accelerator.unwrap_model(m) for n, m in wrapped.items()}
    return LoopResult(history, time.perf_counter() - start, total_images, trained)
