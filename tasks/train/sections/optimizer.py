"""The optimizer: learning rate, AdamW (or bitsandbytes' 8-bit AdamW), clipping, EMA."""
from __future__ import annotations

import importlib.util

from pydantic import Field

from tasks.common.config import StageConfig


class OptimizerSection(StageConfig):
    learning_rate: float = Field(1e-4, gt=0.0, le=1.0, description="peak learning rate (before scale_lr)")
    scale_lr: bool = Field(False, description="multiply the LR by batch size x accumulation x processes")
    use_8bit_adam: bool = Field(False, description="bitsandbytes AdamW8bit: less memory, much slower on CPU")
    adam_beta1: float = Field(0.9, ge=0.0, lt=1.0, description="AdamW beta1")
    adam_beta2: float = Field(0.999, ge=0.0, lt=1.0, description="AdamW beta2")
    adam_weight_decay: float = Field(1e-2, ge=0.0, description="AdamW weight decay")
    adam_epsilon: float = Field(1e-8, gt=0.0, description="AdamW epsilon")
    max_grad_norm: float = Field(1.0, gt=0.0, description="gradient clipping (total L2 norm)")
    # EMA (seed 001; on the CPU as in seed 003)
    use_ema: bool = Field(False, description="keep an exponential moving average of the trained weights; save it")
    ema_decay: float = Field(0.9999, gt=0.0, lt=1.0, description="EMA decay per update (use_ema)")
    offload_ema: bool = Field(False, description="keep the EMA weights in CPU memory (GPU runs)")
    ema_update_every: int = Field(1, ge=1, description="update the EMA every N optimizer steps")

    def _optimizer_problem(self) -> str | None:
        if self.use_8bit_adam and importlib.util.find_spec("bitsandbytes") is None:
            return "use_8bit_adam needs the bitsandbytes package (pip install bitsandbytes), or set it false"
        return None

    def effective_learning_rate(self, num_processes: int) -> float:
        """diffusers' --scale_lr: the LR grows with the images per optimizer step."""
        if not self.scale_lr:
            return self.learning_rate
        return self.learning_rate * self.train_batch_size * self.gradient_accumulation_steps * num_processes
