"""What a training method is, declared without torch: the registry every check asks.

Each method is a `MethodSpec` (tasks/train/methods/specs/<name>.py for the built-in ones): its
name, what it trains, the train.* options only it reads, what it refuses (per family, per base
precision) and what it writes. The config checks (tasks/train/config.py, config_sections.py,
no_ops.py, concepts.py), the data checks and the families ask the spec; none compares a method's
name. The spec names its `TrainingMethod` subclass (`trainer`), which is imported, with torch,
only when training starts.

    spec = method_spec(cfg.method)
    spec.frozen_base, spec.options, spec.family_refusal(family), spec.trainer_class()(cfg)

A new method is one module with a `SPEC` (and its trainer class, there or named by path), listed
in BUILTIN or added with `register(SPEC)` (tasks/train/methods/README.md).
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

#: what a method trains: the base's own weights, adapters beside frozen weights, a new embedding
Trains = Literal["weights", "adapters", "embedding"]
#: what it writes: a full pipeline folder, adapter files, an embedding file
Output = Literal["pipeline", "adapters", "embedding"]
#: a rule on one of a method's options: (does it matter for this config?, what makes it matter)
OptionRule = tuple[Callable[[Any], bool], str]


@dataclass(frozen=True)
class MethodSpec:
    name: str
    summary: str
    trains: Trains
    output: Output
    #: "module:Class" of its TrainingMethod subclass, or the class itself
    trainer: str | type
    #: train.* keys only this method reads (set for another method, they are refused as no-ops)
    options: tuple[str, ...] = ()
    #: finer rules on its own options (e.g. lora_dropout only with some lora_type values)
    option_rules: dict[str, OptionRule] = field(default_factory=dict)
    #: its prompts may be the images' captions (textual inversion writes its own from templates)
    reads_captions: bool = True
    #: several concepts in one run (textual inversion learns one token)
    concepts: bool = True
    #: it trains through the text encoders (a quantized text encoder cannot give it gradients)
    through_text_encoder: bool = False
    #: the family must train embeddings (ModelFamily.trains_embeddings)
    needs_embeddings: bool = False
    #: the caption column it reads when train.caption_column is null (None: the instance prompt)
    default_caption_column: str | None = None
    #: its own config problems (the train config in, a message or None out)
    check: Callable[[Any], str | None] | None = None

    @property
    def frozen_base(self) -> bool:
        """The base's weights stay frozen (adapters or an embedding train): a quantized base fits it."""
        return self.trains != "weights"

    def family_refusal(self, family: Any) -> str | None:
        """Why `family` (a ModelFamily) cannot train this method, or None."""
        if _refused(self, family):
            return (f"train.method: {self.name} is not available for {family.title} (it trains a text embedding, "
                    f"which {family.title} does not train here); choose one of {', '.join(names_for(family))}")
        return None

    def trainer_class(self) -> type:
        if isinstance(self.trainer, type):
            return self.trainer
        module, _, name = self.trainer.partition(":")
        return getattr(importlib.import_module(module), name)


#: the built-in methods' spec modules, in the order they are documented
BUILTIN = ("dreambooth", "textual_inversion", "lora", "full")
_SPECS: dict[str, MethodSpec] = {}


def _load() -> dict[str, MethodSpec]:
    if not _SPECS:
        for name in BUILTIN:
            spec = importlib.import_module(f"tasks.train.methods.specs.{name}").SPEC
            _SPECS[spec.name] = spec
    return _SPECS


def register(spec: MethodSpec) -> None:
    """Add (or replace) a method; train.method then accepts its name."""
    _load()[spec.name] = spec


def unregister(name: str) -> None:
    _load().pop(name, None)


def names() -> tuple[str, ...]:
    return tuple(_load())


def names_for(family: Any) -> list[str]:
    """The methods `family` can train."""
    return [s.name for s in _load().values() if not _refused(s, family)]


def _refused(spec: MethodSpec, family: Any) -> bool:
    return spec.needs_embeddings and not family.trains_embeddings


def names_training(what: Trains) -> list[str]:
    """The methods that train `what` (the base's own weights, adapters, an embedding)."""
    return [s.name for s in _load().values() if s.trains == what]


def method_spec(name: str) -> MethodSpec:
    """The spec of `train.method` `name`, or a ValueError naming the known ones."""
    specs = _load()
    if name not in specs:
        raise ValueError(f"unknown method {name!r}; choose one of {', '.join(specs)}")
    return specs[name]


def option_rules() -> dict[str, OptionRule]:
    """Every method's options as no-op rules: an option matters only under a method that reads it
    (and, with the method's finer rule, only where that rule says)."""
    rules: dict[str, OptionRule] = {}
    for spec in _load().values():
        for key in spec.options:
            readers = [s.name for s in _load().values() if key in s.options]
            rules[key] = (lambda c, key=key: key in method_spec(c.method).options,
                          f"only method: {' or '.join(readers)} reads it")
        rules.update(spec.option_rules)
    return rules
