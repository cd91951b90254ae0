"""What a method writes and how it is loaded back: a full pipeline folder by default (methods that
write adapters or an embedding override these). A mixin of TrainingMethod."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from tasks.train.models import pipeline_from_modules

log = logging.getLogger(__name__)


class Saving:
    """The output: `save` from the trained modules, `complete_output` from files, `load_output`."""

    def live_pipeline(self, base: Path, modules: dict[str, torch.nn.Module]) -> Any:
        """A pipeline over the modules being trained (validation images during training)."""
        return pipeline_from_modules(base, self.components, modules)

    def save(self, base: Path, out_dir: Path, trained: dict[str, torch.nn.Module]) -> None:
        """What the output needs from the trained modules: here a complete pipeline folder, the
        trained modules plus the base's other parts, safetensors. Only the trained modules are still
        in memory (the caller has released the rest); `complete_output` follows once they are gone."""
        # Only the trained modules come from memory; the frozen ones load from the base in their
        # stored precision (in memory they may be bf16).
        pipe = pipeline_from_modules(base, self.components, trained, keep_safety_checker=True)
        if self.cfg.prediction_type is not None:
            # Inference must predict what training taught: carry the target into the scheduler.
            pipe.scheduler = pipe.scheduler.__class__.from_config(
                pipe.scheduler.config, prediction_type=self.cfg.prediction_type
            )
        pipe.save_pretrained(out_dir, safe_serialization=True)
        log.info("saved %s pipeline (%s trained) to %s", self.name, ", ".join(sorted(trained)), out_dir)

    def complete_output(self, base: Path, out_dir: Path) -> None:
        """What the output still needs once the trained modules have left memory (`release`): parts
        made from the base and files already in `out_dir` alone (LoRA: the fused pipeline)."""

    def release(self, keep: set[str] | list[str] = ()) -> None:
        """After training: drop the caches and every module but those named in `keep`, so loading
        the base again (saving, the fused pipeline, final validation) does not sit beside them."""
        self.latent_cache = self.prompt_cache = None
        if self._components is not None:
            self._components.keep_only(set(keep))

    def load_output(self, out_dir: Path, base: Path) -> Any:
        """The saved output as a pipeline, through diffusers' own loaders (final validation)."""
        from diffusers import DiffusionPipeline

        return DiffusionPipeline.from_pretrained(out_dir)
