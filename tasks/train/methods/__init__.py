"""Training methods. Each says only what differs: what is trainable, the data, the loss, the output.

`train.method` names one of METHODS; the loop in tasks/train/loop.py is shared by all.
"""
from __future__ import annotations

from tasks.train.methods.base import TrainingMethod
from tasks.train.methods.dreambooth import DreamBooth

METHODS: dict[str, type[TrainingMethod]] = {DreamBooth.name: DreamBooth}

__all__ = ["METHODS", "TrainingMethod", "DreamBooth"]
