"""Training methods. Each is a spec (tasks/train/method_specs/, outside this folder) that
names its `TrainingMethod` subclass, which says only what differs: what is trainable, the prompts,
the output. The loop in tasks/train/loop.py is shared by all.

Importing this package imports no torch: the trainer classes load when asked for
(`METHODS[name]`, `TrainingMethod`, or `method_spec(name).trainer_class()`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    # The built-in trainers, which their specs (tasks/train/method_specs/) name by path and
    # `spec.trainer_class()` imports when training starts: named here, in their own package, so
    # that the import graph (the train stage's code deps in dvc.yaml) reaches them.
    from tasks.train.methods import dreambooth, full, lora, textual_inversion  # noqa: F401


def __getattr__(name: str) -> Any:
    if name == "METHODS":  # train.method -> its TrainingMethod subclass
        from tasks.train.method_specs import method_spec, names

        return {n: method_spec(n).trainer_class() for n in names()}
    if name == "TrainingMethod":
        from tasks.train.methods.base import TrainingMethod

        return TrainingMethod
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
