"""What a training method is (`MethodSpec`), declared without torch; the registry that every check
asks is tasks/train/method_specs/__init__.py."""
from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel

#: what a method trains: the base's own weights, adapters beside frozen weights, a new embedding
Trains = Literal["weights", "adapters", "embedding"]
#: what it writes: a full pipeline folder, adapter files, an embedding file
Output = Literal["pipeline", "adapters", "embedding"]
#: a rule on one of a method's options: (does it matter for this config?, what makes it matter)
OptionRule = tuple[Callable[[Any], bool], str]


@dataclass(frozen=True)
class MethodSpec:
    name: str
    trains: Trains
    output: Output
    #: "module:Class" of its TrainingMethod subclass, or the class itself
    trainer: str | type
    #: the train.* keys only this method reads: a pydantic model (a StageConfig) of them with their
    #: defaults and validators. TrainConfig holds every registered method's keys flat, beside the
    #: shared sections (tasks/train/sections/); set for another method, they are refused as no-ops.
    options_model: type[BaseModel] | None = None
    #: finer rules on its own options (e.g. lora_dropout only with some lora_type values)
    option_rules: dict[str, OptionRule] = field(default_factory=dict)
    #: those of its options that change what is written, not what a step computes: left out of the
    #: run key, so a resume with other values of them continues the same run
    not_in_run_key: frozenset[str] = frozenset()
    #: its prompts may be the images' captions (textual inversion writes its own from templates)
    reads_captions: bool = True
    #: several concepts in one run (textual inversion learns one token)
    concepts: bool = True
    #: it trains through the text encoders (a quantized text encoder cannot give it gradients)
    through_text_encoder: bool = False
    #: the family must train embeddings (its text conditioner's `trains_embeddings`)
    needs_embeddings: bool = False
    #: the caption column it reads when train.caption_column is null (None: the instance prompt)
    default_caption_column: str | None = None
    #: its own config problems (the train config in, a message or None out)
    check: Callable[[Any], str | None] | None = None
    #: its own refusals for the base's family, before any weights load (the train config and a
    #: ModelFamily in, a message or None out): e.g. LoRA's output format a family's readers cannot load
    family_check: Callable[[Any, Any], str | None] | None = None
    #: its own refusals on a quantized base (the train config and the parsed BasePrecision in, a
    #: message or None out): e.g. LoRA's adapter types that peft cannot put on some quantized layers;
    #: None: only the precision's own checks (its package)
    base_precision_check: Callable[[Any, Any], str | None] | None = None

    @property
    def options(self) -> tuple[str, ...]:
        """The train.* keys only this method reads (its options model's fields)."""
        return tuple(self.options_model.model_fields) if self.options_model else ()

    @property
    def frozen_base(self) -> bool:
        """The base's weights stay frozen (adapters or an embedding train): a quantized base fits it."""
        return self.trains != "weights"

    def fits(self, family: Any) -> bool:
        """Whether `family` (a ModelFamily) can train this method."""
        return family.text.trains_embeddings or not self.needs_embeddings

    def family_problem(self, cfg: Any, family: Any) -> str | None:
        """Why this method's options in `cfg` do not fit `family` (its own `family_check`), or None."""
        return self.family_check(cfg, family) if self.family_check else None

    def base_precision_problem(self, cfg: Any, precision: Any) -> str | None:
        """Why `cfg` cannot train this method on a base quantized as `precision` (a BasePrecision), or None."""
        if self.base_precision_check:
            return self.base_precision_check(cfg, precision)
        return precision.problem()

    def trainer_class(self) -> type:
        if isinstance(self.trainer, type):
            return self.trainer
        module, _, name = self.trainer.partition(":")
        return getattr(importlib.import_module(module), name)
