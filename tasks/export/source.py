"""What the train stage left, made into one diffusers pipeline folder the exporter can convert.

Every training method's output is accepted, detected from the folder's contents:

- a full pipeline (`model_index.json`: DreamBooth, full fine-tunes, textual inversion, LoRA saved
  with `fuse_lora`): exported as it is;
- adapters only (`pytorch_lora_weights.safetensors` and/or `learned_embeds.safetensors`, no
  `model_index.json`): loaded onto the base pipeline (`--base`), the LoRA fused into the weights
  and the new tokens added to the tokenizers, then saved as a full pipeline and exported. OpenVINO
  has no LoRA or token loader of its own at run time, so the concept must be in the weights.

Loading is tasks/common/finetuned.py's (the evaluate stage loads the fine-tune the same way).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from tasks.common.finetuned import detect, load_finetuned

log = logging.getLogger(__name__)


def materialize(src: Path, base: Path | None, work: Path, token: str | None = None) -> tuple[
    Path, dict[str, Any]
]:
    """A full diffusers pipeline for `src`: `src` itself, or base + adapters saved under `work`.

    Returns (pipeline folder, report section {method, base, lora, embeds, tokens}).
    """
    if detect(src).full_pipeline:
        return Path(src), {"method": "full_pipeline"}
    pipe, kind, info = load_finetuned(src, base, token)
    out = Path(work) / "merged-pipeline"
    pipe.save_pretrained(out, safe_serialization=True)
    log.info("merged pipeline (%s from %s on %s) at %s", kind.method, src, base, out)
    return out, info
