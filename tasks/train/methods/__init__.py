"""Training methods. Each says only what differs: what is trainable, the prompts, the output.

`train.method` names one of METHODS; the loop in tasks/train/loop.py is shared by all.
"""
from __future__ import annotations

from tasks.train.methods.base import TrainingMethod
from tasks.train.methods.dreambooth import DreamBooth
from tasks.train.methods.full import FullFineTune
from tasks.train.methods.lora import LoRA
from tasks.train.methods.textual_inversion import TextualInversion

METHODS: dict[str, type[TrainingMethod]] = {
    m.name: m for m in (DreamBooth, TextualInversion, LoRA, FullFineTune)
}

__all__ = ["METHODS", "TrainingMethod", "DreamBooth", "TextualInversion", "LoRA", "FullFineTune"]
