"""The `export` section of params.yaml."""
from __future__ import annotations

from pydantic import Field, model_validator

from tasks.common.config import StageConfig


class ParityConfig(StageConfig):
    """The same prompt, seed and initial latents through PyTorch and OpenVINO, compared."""

    enabled: bool = Field(True, description="false: skip the comparison (and its gate)")
    prompt: str = Field("a photo of sks toy", min_length=1)
    num_inference_steps: int = Field(5, ge=1, le=200)
    guidance_scale: float = Field(7.5, gt=1.0, description="> 1: the static UNet batch has CFG")
    seed: int = Field(0, ge=0, description="seed of the shared initial latents")
    min_psnr_db: float | None = Field(
        30.0, description="fail when image PSNR (OpenVINO vs PyTorch) is below; null: record only"
    )


class ExportConfig(StageConfig):
    """`export` section: the static shape of the OpenVINO pipeline, and the parity check."""

    batch_size: int = Field(1, ge=1, le=64, description="prompts per pipeline call")
    height: int = Field(64, ge=8, le=4096, multiple_of=8)
    width: int = Field(64, ge=8, le=4096, multiple_of=8)
    num_images_per_prompt: int = Field(1, ge=1, le=64)
    parity: ParityConfig = Field(default_factory=ParityConfig)

    @model_validator(mode="after")
    def _batch_not_huge(self) -> "ExportConfig":
        if self.batch_size * self.num_images_per_prompt > 64:
            raise ValueError("batch_size x num_images_per_prompt must be at most 64")
        return self
