"""What a training method is, declared without torch: the registry every check asks.

Each method is a `MethodSpec` (tasks/train/method_specs/<name>.py for the built-in ones): its
name, what it trains, the train.* options only it reads (its options model, with their defaults
and validators: TrainConfig holds them flat beside the shared sections), what it refuses (per
family, per base precision) and what it writes. The config checks (tasks/train/config.py, sections/, no_ops.py,
concepts.py), the data checks and the families ask the spec; none compares a method's name. The
spec names its `TrainingMethod` subclass (`trainer`, in tasks/train/methods/), which is imported,
with torch, only when training starts.

Imports go one way: the trainers (tasks/train/methods/) import the config and this registry;
nothing here, nor the config, imports a trainer (tests/train/test_method_specs.py).

    spec = method_spec(cfg.method)
    spec.frozen_base, spec.options, family_refusal(spec, family), spec.trainer_class()(cfg)

A new method is one module with a `SPEC` (and its trainer class, there or named by path), listed
in BUILTIN below or added with `register(SPEC)` (tasks/train/methods/README.md).
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from finetune_runtime.registry import Registry
from tasks.train.method_specs import dreambooth, full, lora, textual_inversion
from tasks.train.method_specs.base import MethodSpec, OptionRule, Trains

#: the built-in methods, in the order they are documented in
BUILTIN = (dreambooth.SPEC, textual_inversion.SPEC, lora.SPEC, full.SPEC)

#: every method, in order (finetune_runtime/registry.py: the registry style of families, adapter types,
#: output formats and serving back ends too)
SPECS: Registry[MethodSpec] = Registry("method", BUILTIN)
#: the options models TrainConfig was built from (`options_models()`); None: not built yet
_BUILT: tuple[type[BaseModel], ...] | None = None


def register(spec: MethodSpec) -> None:
    """Add (or replace) a method; train.method then accepts its name. A method with options of its
    own is registered before tasks.train.config is imported: its keys become TrainConfig's then."""
    if _BUILT is not None and spec.options_model is not None and spec.options_model not in _BUILT:
        raise ValueError(f"method {spec.name}: its options ({', '.join(spec.options)}) are train.* keys, which "
                         "TrainConfig fixed when tasks.train.config was imported; register the method before "
                         "that import (or list it in BUILTIN)")
    SPECS.register(spec)


def unregister(name: str) -> None:
    SPECS.unregister(name)


def names() -> tuple[str, ...]:
    return SPECS.names()


def names_for(family: Any) -> list[str]:
    """The methods `family` can train."""
    return [s.name for s in SPECS if s.fits(family)]


def family_refusal(spec: MethodSpec, family: Any) -> str | None:
    """Why `family` (a ModelFamily) cannot train `spec`'s method, or None."""
    if spec.fits(family):
        return None
    return (f"train.method: {spec.name} is not available for {family.title} (it trains a text embedding, "
            f"which {family.title} does not train here); choose one of {', '.join(names_for(family))}")


def names_training(what: Trains) -> list[str]:
    """The methods that train `what` (the base's own weights, adapters, an embedding)."""
    return [s.name for s in SPECS if s.trains == what]


def method_spec(name: str) -> MethodSpec:
    """The spec of `train.method` `name`, or a ValueError naming the known ones."""
    return SPECS.get(name)


def options_models() -> tuple[type[BaseModel], ...]:
    """Every registered method's options model, once each, in the methods' order: TrainConfig
    holds their keys flat beside the shared sections' (tasks/train/config.py). Two models may not
    declare the same key (two methods reading one key share one model)."""
    global _BUILT
    models = tuple(dict.fromkeys(s.options_model for s in SPECS if s.options_model is not None))
    owners: dict[str, str] = {}
    for model in models:
        for key in model.model_fields:
            if key in owners:
                raise ValueError(f"train.{key} is declared by both {owners[key]} and {model.__name__}; "
                                 "methods that read one key share one options model")
            owners[key] = model.__name__
    _BUILT = models
    return models


def not_in_run_key() -> frozenset[str]:
    """The methods' options that change what is written, not a step (left out of the run key)."""
    return frozenset().union(*(s.not_in_run_key for s in SPECS))


def option_rules() -> dict[str, OptionRule]:
    """Every method's options as no-op rules: an option matters only under a method that reads it
    (and, with the method's finer rule, only where that rule says)."""
    rules: dict[str, OptionRule] = {}
    for spec in SPECS:
        for key in spec.options:
            readers = [s.name for s in SPECS if key in s.options]
            rules[key] = (lambda c, key=key: key in method_spec(c.method).options,
                          f"only method: {' or '.join(readers)} reads it")
        rules.update(spec.option_rules)
    return rules
