"""Fusing a diffusers LoRA file into a pipeline, for the outputs that need plain weights.

Used by the train stage (`fuse_lora: true` writes the fused pipeline next to the adapters) and by
the export and evaluate stages (tasks/common/finetuned.py: adapters are fused into the base before
conversion, and before generating with the fine-tune in PyTorch).

transformers 5 works around one thing here: loading adapters into a text encoder adds a key
renaming (`base_model.model.model.` -> `model.`) to the model's `_weight_conversions`, which
`unload_lora_weights()` leaves behind; `save_pretrained` then applies it backwards to every key
containing `model.`, and a CLIP text encoder is saved as `text_base_model.model.model.*`, which
nothing loads (its weights come back random). The renamings are put back as they were.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from tasks.common import families


def fuse_lora_file(pipe: Any, lora: Path, components: list[str] | None = None) -> list[str]:
    """Load the LoRA file `lora` into `pipe`, fuse it, drop the adapter modules; returns the fused
    components (every component the pipeline has and `components` names, or all it has)."""
    names = [n for n in (components or pipe.components) if getattr(pipe, n, None) is not None]
    saved = {n: list(getattr(pipe, n)._weight_conversions) for n in names
             if getattr(getattr(pipe, n), "_weight_conversions", None) is not None}
    pipe.load_lora_weights(Path(lora).parent, weight_name=Path(lora).name)
    family = families.of_pipeline(pipe)
    loadable = getattr(pipe, "_lora_loadable_modules", None)  # FLUX.1's T5 takes no LoRA
    lora_names = [n for n in names if (n == family.denoiser.name or n in family.text.encoder_names)
                  and (loadable is None or n in loadable)]
    pipe.fuse_lora(components=lora_names)
    pipe.unload_lora_weights()
    for name, conversions in saved.items():
        getattr(pipe, name)._weight_conversions = conversions
    return lora_names
