"""Textual inversion (Gal et al. 2022): one new token's embedding, learnt through the frozen text
encoders on diffusers' prompt templates; an embedding file."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from tasks.common.config import StageConfig
from tasks.train.method_specs.base import MethodSpec


class TextualInversionOptions(StageConfig):
    """The keys method textual_inversion reads: the new token, where it starts, its prompts."""

    placeholder_token: str | None = Field(None, min_length=1, description="new token, e.g. <sks-toy>")
    initializer_token: str | None = Field(None, min_length=1, description="one existing token to start from")
    num_vectors: int = Field(1, ge=1, le=64, description="embedding vectors learned for the placeholder")
    learnable_property: Literal["object", "style"] = Field("object", description="prompt templates to train with")


def _problem(cfg: Any) -> str | None:
    if not cfg.placeholder_token or not cfg.initializer_token:
        return ("textual_inversion needs placeholder_token (a new token such as '<sks-toy>') and "
                "initializer_token (one existing word such as 'toy')")
    if cfg.with_prior_preservation:
        return ("textual_inversion does not use class images (their prompts lack the placeholder): "
                "set with_prior_preservation: false")
    if cfg.train_text_encoder:
        return "textual_inversion trains only the new token's embedding: set train_text_encoder: false"
    return None


SPEC = MethodSpec(
    name="textual_inversion",
    trains="embedding",
    output="embedding",
    trainer="tasks.train.methods.textual_inversion:TextualInversion",
    options_model=TextualInversionOptions,
    reads_captions=False,
    concepts=False,
    through_text_encoder=True,
    needs_embeddings=True,
    check=_problem,
)
