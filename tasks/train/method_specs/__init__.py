"""What a training method is, declared without torch: the registry every check asks.

Each method is a `MethodSpec` (tasks/train/method_specs/<name>.py for the built-in ones): its
name, what it trains, the train.* options only it reads, what it refuses (per family, per base
precision) and what it writes. The config checks (tasks/train/config.py, sections/, no_ops.py,
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

from tasks.train.method_specs import dreambooth, full, lora, textual_inversion
from tasks.train.method_specs.base import MethodSpec, OptionRule, Trains

#: the built-in methods, in the order they are documented in
BUILTIN = (dreambooth.SPEC, textual_inversion.SPEC, lora.SPEC, full.SPEC)

_SPECS: dict[str, MethodSpec] = {spec.name: spec for spec in BUILTIN}


def register(spec: MethodSpec) -> None:
    """Add (or replace) a method; train.method then accepts its name."""
    _SPECS[spec.name] = spec


def unregister(name: str) -> None:
    _SPECS.pop(name, None)


def names() -> tuple[str, ...]:
    return tuple(_SPECS)


def names_for(family: Any) -> list[str]:
    """The methods `family` can train."""
    return [s.name for s in _SPECS.values() if s.fits(family)]


def family_refusal(spec: MethodSpec, family: Any) -> str | None:
    """Why `family` (a ModelFamily) cannot train `spec`'s method, or None."""
    if spec.fits(family):
        return None
    return (f"train.method: {spec.name} is not available for {family.title} (it trains a text embedding, "
            f"which {family.title} does not train here); choose one of {', '.join(names_for(family))}")


def names_training(what: Trains) -> list[str]:
    """The methods that train `what` (the base's own weights, adapters, an embedding)."""
    return [s.name for s in _SPECS.values() if s.trains == what]


def method_spec(name: str) -> MethodSpec:
    """The spec of `train.method` `name`, or a ValueError naming the known ones."""
    if name not in _SPECS:
        raise ValueError(f"unknown method {name!r}; choose one of {', '.join(_SPECS)}")
    return _SPECS[name]


def option_rules() -> dict[str, OptionRule]:
    """Every method's options as no-op rules: an option matters only under a method that reads it
    (and, with the method's finer rule, only where that rule says)."""
    rules: dict[str, OptionRule] = {}
    for spec in _SPECS.values():
        for key in spec.options:
            readers = [s.name for s in _SPECS.values() if key in s.options]
            rules[key] = (lambda c, key=key: key in method_spec(c.method).options,
                          f"only method: {' or '.join(readers)} reads it")
        rules.update(spec.option_rules)
    return rules
