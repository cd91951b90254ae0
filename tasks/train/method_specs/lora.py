"""LoRA with peft (LoRA, DoRA, LoKr, LoHa) on the denoiser's attention projections (and the text
encoders' with train_text_encoder), over a frozen, possibly quantized base; adapter files."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from tasks.common import adapter_formats, adapters
from tasks.common.config import StageConfig
from tasks.train.method_specs.base import MethodSpec


class LoRAOptions(StageConfig):
    """The keys method lora reads: the adapter's type and shape, and what is written."""

    rank: int = Field(4, ge=1, le=1024, description="LoRA rank")
    lora_alpha: float | None = Field(None, gt=0.0, description="LoRA alpha; null: equal to rank")
    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout probability of the LoRA layers")
    fuse_lora: bool = Field(True, description="also write the base pipeline with the LoRA fused in (for export)")
    lora_type: Literal[adapters.TYPES.names()] = Field(  # type: ignore[valid-type]
        "lora", description="lora | dora (weight-decomposed) | lokr (Kronecker) | loha (Hadamard), peft's layers")
    decompose_factor: int = Field(-1, ge=-1, description="LoKr: the Kronecker factor (peft's name); -1: automatic")
    lora_format: str = Field("diffusers", description=adapter_formats.describe())

    @field_validator("lora_format")
    @classmethod
    def _known_format(cls, v: str) -> str:
        adapter_formats.adapter_format(v)  # a ValueError naming the registered formats
        return v


def _family_problem(cfg: Any, family: Any) -> str | None:
    """An output format the family's readers cannot load (ComfyUI has no Sana model)."""
    return adapter_formats.format_refusal(cfg.lora_format, family)


def _base_precision_problem(cfg: Any, precision: Any) -> str | None:
    """The precision's own checks, and the adapter types peft cannot put on its quantized layers."""
    return precision.problem(adapter=cfg.lora_type)


def _dropout(adapter: adapters.AdapterType) -> bool:
    return adapter.diffusers_file


def _factor(adapter: adapters.AdapterType) -> bool:
    return adapter.decompose_factor


SPEC = MethodSpec(
    name="lora",
    trains="adapters",
    output="adapters",
    trainer="tasks.train.methods.lora:LoRA",
    options_model=LoRAOptions,
    option_rules={
        # peft_config builds peft's LoraConfig, the one with a dropout, for these types only
        "lora_dropout": (lambda c: c.method == SPEC.name and adapters.adapter_type(c.lora_type).diffusers_file,
                         f"only method: lora with lora_type {' or '.join(adapters.names_where(_dropout))} has "
                         "LoRA's dropout (peft's LoKr and LoHa do not)"),
        "decompose_factor": (lambda c: c.method == SPEC.name and adapters.adapter_type(c.lora_type).decompose_factor,
                             f"only method: lora with lora_type: {' or '.join(adapters.names_where(_factor))} has "
                             "a Kronecker factor"),
    },
    not_in_run_key=frozenset({"fuse_lora", "lora_format"}),
    family_check=_family_problem,
    base_precision_check=_base_precision_problem,
)
