from __future__ import annotations

from pydantic import Field, field_validator

from tasks.common import families
from tasks.common.config import StageConfig


class BaseConfig(StageConfig):
    """`base` section of params.yaml."""

    model: str = Field(
        "builtin:tiny-sd",
        description=f"{' | '.join(families.BUILTINS)} | a hub id (org/name) | a local diffusers folder",
    )
    revision: str | None = Field(None, description="pinned commit of a hub model (required for hub ids)")
    seed: int = Field(0, ge=0, description="seed of the built-in models' weights")

    @field_validator("model")
    @classmethod
    def _not_empty(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must name a model: builtin:tiny-sd, a hub id or a local folder")
        return v.strip()
