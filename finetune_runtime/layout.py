"""The names a registered version and a train output are made of, written once.

A version's pyfunc artifacts are folders under these keys; a train output folder holds a full
diffusers pipeline, or adapters only (`contents` says which), which the stages and the served
model load the same way (load.py, adapters.py).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

# --- a registered version's artifacts (MLflow `artifacts` keys) ---------------------------------
#: the train stage's output: a full pipeline, or adapters (and learned embeddings) only
FINETUNED = "finetuned"
#: the export stage's OpenVINO pipeline
OPENVINO = "openvino"
#: the base pipeline an adapters-only fine-tune applies to, copied into the version
BASE = "base"
#: a base too big to copy: where it was and what it held (base_reference.py)
BASE_REFERENCE = "base_reference"
#: a run-time adapter version's files (genai_serving.py)
ADAPTER = "adapter"

# --- what a train output folder holds -----------------------------------------------------------
MODEL_INDEX = "model_index.json"
#: diffusers' LoRA file (LoRA, DoRA), which every family's `load_lora_weights` reads
LORA_WEIGHTS = "pytorch_lora_weights.safetensors"
#: LoKr and LoHa in peft's layout, one folder per adapted component
PEFT_DIR = "peft_adapters"
PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
#: textual inversion's learned token embeddings
EMBEDS = "learned_embeds.safetensors"

# --- what an export folder holds ----------------------------------------------------------------
#: the OpenVINO settings the export stage validated the export at
OV_RUNTIME = "openvino_runtime.json"
#: How an export without OV_RUNTIME is compiled: fp32. Left to itself, OpenVINO picks a lower
#: precision on CPUs with bf16 (measured here: 51 dB PSNR against PyTorch by default, ~100 dB with
#: f32), so results would differ between machines unless the precision is stated.
DEFAULT_OV_CONFIG = {"INFERENCE_PRECISION_HINT": "f32"}
#: a base export that serves registered adapters at run time (genai_serving.py)
GENAI_BASE = "genai_base.json"


def runtime_config(export: str | os.PathLike) -> dict[str, str]:
    """The OpenVINO settings an export folder asks for (its OV_RUNTIME; fp32 without it)."""
    file = Path(export) / OV_RUNTIME
    if not file.is_file():
        return dict(DEFAULT_OV_CONFIG)
    return dict(json.loads(file.read_text())["ov_config"])


def is_pipeline(folder: str | os.PathLike) -> bool:
    """Whether `folder` holds a diffusers pipeline (its model_index.json)."""
    return os.path.isfile(os.path.join(folder, MODEL_INDEX))


def peft_components(folder: str | os.PathLike) -> list[str]:
    """The components a peft adapters folder has adapters for."""
    if not os.path.isdir(folder):
        return []
    return sorted(name for name in os.listdir(folder) if os.path.isfile(os.path.join(folder, name, PEFT_CONFIG)))


@dataclass(frozen=True)
class Contents:
    """What a train output folder holds; each path is None where it holds no such thing."""

    full_pipeline: bool
    lora: Path | None  # diffusers' LoRA file (LoRA, DoRA), or peft's adapters folder (LoKr, LoHa)
    embeds: Path | None

    @property
    def method(self) -> str:
        """'full_pipeline', 'lora', 'textual_inversion' or 'lora+textual_inversion'."""
        if self.full_pipeline:
            return "full_pipeline"
        return "+".join(name for name, f in (("lora", self.lora), ("textual_inversion", self.embeds)) if f)

    @property
    def empty(self) -> bool:
        return not (self.full_pipeline or self.lora or self.embeds)


def contents(folder: str | os.PathLike) -> Contents:
    """What `folder` (a train output) holds; a folder that holds nothing loadable is `empty`."""
    folder = Path(folder)
    lora = next((p for p in (folder / LORA_WEIGHTS, folder / PEFT_DIR) if p.is_file() or peft_components(p)), None)
    embeds = folder / EMBEDS
    return Contents(is_pipeline(folder), lora, embeds if embeds.is_file() else None)
