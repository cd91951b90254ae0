"""The `train` section of params.yaml. Option names follow diffusers' example scripts."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tasks.common.config import StageConfig

LR_SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts", "polynomial")


class TrainConfig(StageConfig):
    """`train` section: what to train and how (where and on how many machines is not here)."""

    method: Literal["dreambooth"] = Field("dreambooth", description="training method")
    # DreamBooth
    instance_prompt: str = Field("a photo of sks toy", min_length=1, description="prompt with the unique identifier")
    class_prompt: str = Field("a photo of a toy", min_length=1, description="prompt of the class images")
    with_prior_preservation: bool = Field(True, description="add the prior-preservation loss over class images")
    prior_loss_weight: float = Field(1.0, ge=0.0, description="weight of the prior-preservation loss")
    train_text_encoder: bool = Field(False, description="also train the text encoder(s)")
    # data
    resolution: int = Field(64, ge=8, le=4096, multiple_of=8, description="training images are resized/cropped to this")
    center_crop: bool = Field(True, description="centre crop (false: random crop)")
    random_flip: bool = Field(False, description="flip images horizontally at random")
    train_batch_size: int = Field(2, ge=1, le=4096, description="instance images per device per step")
    dataloader_num_workers: int = Field(0, ge=0, le=64)
    # optimisation
    max_train_steps: int = Field(20, ge=1, description="optimizer steps")
    gradient_accumulation_steps: int = Field(1, ge=1, le=1024)
    gradient_checkpointing: bool = Field(False, description="trade compute for memory in the UNet")
    learning_rate: float = Field(1e-4, gt=0.0, le=1.0)
    lr_scheduler: Literal[LR_SCHEDULERS] = Field("constant")  # type: ignore[valid-type]
    lr_warmup_steps: int = Field(0, ge=0)
    adam_beta1: float = Field(0.9, ge=0.0, lt=1.0)
    adam_beta2: float = Field(0.999, ge=0.0, lt=1.0)
    adam_weight_decay: float = Field(1e-2, ge=0.0)
    adam_epsilon: float = Field(1e-8, gt=0.0)
    max_grad_norm: float = Field(1.0, gt=0.0, description="gradient clipping (total L2 norm)")
    mixed_precision: Literal["no", "bf16", "fp16"] = Field(
        "no", description="no | bf16 (autocast, also on CPU) | fp16 (CUDA only)"
    )
    prediction_type: Literal["epsilon", "v_prediction"] | None = Field(
        None, description="training target; null: the base model's scheduler setting"
    )
    # reporting
    validation_prompt: str | None = Field(None, description="prompt of the final validation grid; null: instance_prompt")
    num_validation_images: int = Field(4, ge=0, le=64, description="images in the final validation grid (0: none)")
    validation_inference_steps: int = Field(10, ge=1, le=1000)
    log_every_steps: int = Field(1, ge=1, description="MLflow metrics every N steps (the CSV has every step)")
    seed: int = Field(0, ge=0, description="same seed and params give the same weights")

    @model_validator(mode="after")
    def _check(self) -> "TrainConfig":
        if self.mixed_precision == "fp16":
            import torch

            if not torch.cuda.is_available():
                raise ValueError(
                    "mixed_precision fp16 needs a CUDA GPU (CPUs have no fp16 autocast for training); "
                    "use bf16 or no"
                )
        if self.lr_warmup_steps > self.max_train_steps:
            raise ValueError("lr_warmup_steps is larger than max_train_steps")
        return self
