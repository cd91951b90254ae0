"""The optimizer: which one (diffusers' `optimizer`, with Prodigy's options by diffusers' names),
the learning rate, AdamW's betas and decay (shared by the others where they have them), clipping, EMA."""
from __future__ import annotations

import importlib.util
from typing import Literal

from pydantic import Field

from tasks.common.config import StageConfig

OPTIMIZERS = ("adamw", "adamw8bit", "prodigy", "adafactor", "schedulefree_adamw", "lion")
#: the package each optimizer needs beyond torch: (import name, pip name)
PACKAGES = {"adamw8bit": ("bitsandbytes", "bitsandbytes"), "prodigy": ("prodigyopt", "prodigyopt"),
            "schedulefree_adamw": ("schedulefree", "schedulefree"), "lion": ("lion_pytorch", "lion-pytorch")}


class OptimizerSection(StageConfig):
    learning_rate: float = Field(1e-4, gt=0.0, le=1.0, description="peak learning rate (before scale_lr); "
                                                                    "prodigy: a multiplier of its own estimate, 1.0")
    scale_lr: bool = Field(False, description="multiply the LR by batch size x accumulation x processes")
    optimizer: Literal[OPTIMIZERS] = Field(  # type: ignore[valid-type]
        "adamw", description=" | ".join(OPTIMIZERS) + " (tasks/train/README.md, 'Optimizers')")
    use_8bit_adam: bool = Field(False, description="bitsandbytes AdamW8bit (as optimizer: adamw8bit): less memory, "
                                                   "much slower on CPU")
    adam_beta1: float = Field(0.9, ge=0.0, lt=1.0, description="beta1 of AdamW, Prodigy, schedule-free AdamW, Lion")
    adam_beta2: float = Field(0.999, ge=0.0, lt=1.0, description="beta2 of AdamW, Prodigy, schedule-free AdamW, Lion "
                                                                 "(Lion's paper: 0.99)")
    adam_weight_decay: float = Field(1e-2, ge=0.0, description="weight decay (every optimizer)")
    adam_epsilon: float = Field(1e-8, gt=0.0, description="epsilon of AdamW, Prodigy, schedule-free AdamW")
    prodigy_beta3: float | None = Field(None, ge=0.0, lt=1.0, description="Prodigy's step-size average; "
                                                                           "null: sqrt(adam_beta2)")
    prodigy_decouple: bool = Field(True, description="Prodigy: AdamW-style decoupled weight decay")
    prodigy_use_bias_correction: bool = Field(True, description="Prodigy: Adam's bias correction")
    prodigy_safeguard_warmup: bool = Field(True, description="Prodigy: lr out of the D estimate's denominator "
                                                             "(for warm-up schedules)")
    max_grad_norm: float = Field(1.0, gt=0.0, description="gradient clipping (total L2 norm)")
    # EMA (seed 001; on the CPU as in seed 003)
    use_ema: bool = Field(False, description="keep an exponential moving average of the trained weights; save it")
    ema_decay: float = Field(0.9999, gt=0.0, lt=1.0, description="EMA decay per update (use_ema)")
    offload_ema: bool = Field(False, description="keep the EMA weights in CPU memory (GPU runs)")
    ema_update_every: int = Field(1, ge=1, description="update the EMA every N optimizer steps")

    @property
    def optimizer_choice(self) -> str:
        """`optimizer`, with `use_8bit_adam` (diffusers' spelling of adamw8bit) folded in."""
        return "adamw8bit" if self.use_8bit_adam else self.optimizer

    def _optimizer_problem(self) -> str | None:
        if self.use_8bit_adam and self.optimizer not in ("adamw", "adamw8bit"):
            return (f"use_8bit_adam makes AdamW 8-bit, but optimizer is {self.optimizer}: set use_8bit_adam: false "
                    "(or optimizer: adamw8bit)")
        name = self.optimizer_choice
        if name in PACKAGES and importlib.util.find_spec(PACKAGES[name][0]) is None:
            key = "use_8bit_adam" if self.use_8bit_adam else f"optimizer: {name}"
            package = PACKAGES[name][1]
            return f"{key} needs the {package} package (pip install {package}), or another optimizer"
        if name == "schedulefree_adamw":
            return self._schedule_free_problem()
        return None

    def _schedule_free_problem(self) -> str | None:
        """Schedule-free AdamW trains at a point y and validates and saves the average x it keeps."""
        key = "optimizer: schedulefree_adamw"
        if self.use_ema:
            return (f"{key} averages its own iterates (the weights it validates and saves); use_ema would average "
                    "its training point instead: set use_ema: false, or another optimizer")
        if self.lr_scheduler not in ("constant", "constant_with_warmup"):
            return (f"{key} replaces the learning-rate schedule; lr_scheduler: {self.lr_scheduler} would decay it "
                    "as well: set lr_scheduler: constant (or constant_with_warmup)")
        if self.select_checkpoint == "best":
            return (f"{key} keeps its training point in checkpoints (what resumes exactly), not the averaged weights "
                    "it saves at the end, so select_checkpoint: best would write the wrong weights: set "
                    "select_checkpoint: last, or another optimizer")
        return None

    def effective_learning_rate(self, num_processes: int) -> float:
        """diffusers' --scale_lr: the LR grows with the images per optimizer step."""
        if not self.scale_lr:
            return self.learning_rate
        return self.learning_rate * self.train_batch_size * self.gradient_accumulation_steps * num_processes
