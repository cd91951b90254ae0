"""What trains beside (or instead of) the denoiser's weights: the text encoders, textual
inversion's new token, LoRA and its adapter types. Each key here is read by one method only
(tasks/train/method_specs/: set for another, it is refused as a no-op)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from tasks.common import adapter_formats
from tasks.common.adapters import ADAPTER_TYPES
from tasks.common.config import StageConfig


class AdaptersSection(StageConfig):
    train_text_encoder: bool = Field(False, description="also train the text encoder(s) (LoRA: add adapters)")
    # textual inversion
    placeholder_token: str | None = Field(None, min_length=1, description="new token, e.g. <sks-toy>")
    initializer_token: str | None = Field(None, min_length=1, description="one existing token to start from")
    num_vectors: int = Field(1, ge=1, le=64, description="embedding vectors learned for the placeholder")
    learnable_property: Literal["object", "style"] = Field("object", description="prompt templates to train with")
    # LoRA
    rank: int = Field(4, ge=1, le=1024, description="LoRA rank")
    lora_alpha: float | None = Field(None, gt=0.0, description="LoRA alpha; null: equal to rank")
    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout probability of the LoRA layers")
    fuse_lora: bool = Field(True, description="also write the base pipeline with the LoRA fused in (for export)")
    lora_type: Literal[ADAPTER_TYPES] = Field(  # type: ignore[valid-type]
        "lora", description="lora | dora (weight-decomposed) | lokr (Kronecker) | loha (Hadamard), peft's layers")
    decompose_factor: int = Field(-1, ge=-1, description="LoKr: the Kronecker factor (peft's name); -1: automatic")
    lora_format: str = Field("diffusers", description=adapter_formats.describe())

    @field_validator("lora_format")
    @classmethod
    def _known_format(cls, v: str) -> str:
        adapter_formats.adapter_format(v)  # a ValueError naming the registered formats
        return v
