"""What is trained and saved: the method (one of the registered specs, tasks/train/method_specs/,
each with its own options model) and whether the text encoders train too."""
from __future__ import annotations

from pydantic import Field, field_validator

from tasks.common.config import StageConfig
from tasks.train.method_specs import MethodSpec, method_spec, names


class MethodSection(StageConfig):
    method: str = Field("dreambooth", description=" | ".join(names()) + " (tasks/train/method_specs/)")
    train_text_encoder: bool = Field(False, description="also train the text encoder(s) (LoRA: add adapters)")

    @field_validator("method")
    @classmethod
    def _known_method(cls, v: str) -> str:
        method_spec(v)  # a ValueError naming the known methods
        return v

    @property
    def spec(self) -> MethodSpec:
        """What `method` is (tasks/train/method_specs/)."""
        return method_spec(self.method)

    def _method_problem(self) -> str | None:
        return self.spec.check(self) if self.spec.check else None
