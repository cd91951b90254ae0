"""A family's pipeline classes: which diffusers pipeline its folders are, one of the roles a family is
built from.

The `_class_name`s of model_index.json the family loads (the first is the class it builds and saves
with), how a folder is recognised as the family's (`families.detect`), and what a base folder needs
before it loads here. A family that recognises more than its class names (SD 1.x/2.x's img2img and
inpaint variants) or rewrites its base folder (Qwen-Image-Edit's processor) subclasses it in its module.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class PipelineClasses:
    """The diffusers pipeline classes of one family."""

    #: model_index.json `_class_name`s this family loads; the first is diffusers' class it builds
    names: tuple[str, ...] = ()

    def matches(self, index: dict[str, Any]) -> bool:
        """True when a model_index.json belongs to this family."""
        return index.get("_class_name") in self.names

    def diffusers_class(self) -> type:
        """diffusers' pipeline class (the first of `names`)."""
        import diffusers

        return getattr(diffusers, self.names[0])

    def prepare(self, folder: Path) -> None:
        """Make a base folder the base stage wrote (downloaded, copied or built) loadable here; nothing
        for most families."""
