"""The `evaluate` section of params.yaml."""
from __future__ import annotations

import string

from pydantic import Field, field_validator, model_validator

from tasks.common.config import StageConfig

_FIELDS = {"identifier", "class_name"}


class GateConfig(StageConfig):
    """Promotion gate: every threshold that is not null must hold (>=) for `gate.passed`.

    `min_<metric>` bounds the fine-tuned model's score; `min_gain_<metric>` bounds fine-tuned
    minus base on the same prompts and seeds (negative = a tolerated loss).
    """

    min_clip_t: float | None = Field(None, ge=-1.0, le=1.0)
    min_clip_i: float | None = Field(None, ge=-1.0, le=1.0)
    min_dino: float | None = Field(None, ge=-1.0, le=1.0)
    min_gain_clip_t: float | None = Field(None, ge=-2.0, le=2.0)
    min_gain_clip_i: float | None = Field(None, ge=-2.0, le=2.0)
    min_gain_dino: float | None = Field(None, ge=-2.0, le=2.0)


class EvaluateConfig(StageConfig):
    """`evaluate` section: prompts, sampling, encoders and the gate."""

    identifier: str = Field("sks", min_length=1, description="the rare token naming the subject")
    class_name: str = Field("toy", min_length=1)
    prompts: list[str] = Field(min_length=1, description="templates: {identifier}, {class_name}")
    images_per_prompt: int = Field(2, ge=1, le=64)
    num_inference_steps: int = Field(10, ge=1, le=500)
    guidance_scale: float = Field(
        7.5, gt=1.0, description="> 1: a static OpenVINO export's UNet batch has the CFG branch"
    )
    seed: int = Field(0, ge=0, description="image j of each prompt starts from seed + j's latents")
    compare_base: bool = Field(True, description="also generate with the base model (PyTorch)")
    clip_model: str = Field("builtin:tiny-clip", min_length=1)
    clip_revision: str | None = Field(None, description="pinned commit for a hub clip_model")
    dino_model: str = Field("builtin:tiny-dino", min_length=1)
    dino_revision: str | None = Field(None, description="pinned commit for a hub dino_model")
    encoder_seed: int = Field(0, ge=0, description="weights of the built-in encoders")
    gate: GateConfig = Field(default_factory=GateConfig)

    @field_validator("prompts")
    @classmethod
    def _templates(cls, prompts: list[str]) -> list[str]:
        for prompt in prompts:
            if not prompt.strip():
                raise ValueError("prompts must not be empty")
            names = {f for _, f, _, _ in string.Formatter().parse(prompt) if f is not None}
            unknown = names - _FIELDS
            if unknown:
                raise ValueError(
                    f"{prompt!r} uses {sorted(unknown)}; only {{identifier}} and {{class_name}} "
                    "are filled in"
                )
        return prompts

    @model_validator(mode="after")
    def _gains_need_base(self) -> "EvaluateConfig":
        keys = ("min_gain_clip_t", "min_gain_clip_i", "min_gain_dino")
        gains = [k for k in keys if getattr(self.gate, k) is not None]
        if gains and not self.compare_base:
            raise ValueError(
                f"gate.{gains[0]} needs compare_base: true (the gain is measured against the base)"
            )
        return self
