"""The `register` section of params.yaml."""
from __future__ import annotations

from pydantic import Field

from tasks.common.config import StageConfig


class RegisterConfig(StageConfig):
    """Where the model goes in the MLflow registry.

    Issue 7 adds champion/challenger keys here (primary metric, direction); the alias logic in
    core.py takes its decision from one function so that change stays local.
    """

    model_name: str = Field(
        min_length=1,
        max_length=256,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
        description="registered model name; letters, digits, '.', '_' and '-'",
    )
