"""What a registered version carries: its artifacts, the packages it pins, how it calls its pipeline.

`model_artifacts` decides which folders a version logs for each train output and export
(docs/registry.md, "The registry", method x export table); `call_convention` what the served model's config records
about its family's pipeline call; `pip_requirements` the versions that logged it.
"""
from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import Any

from finetune_runtime import layout
from finetune_runtime.convention import CONFIG_KEY
from finetune_runtime.layout import LORA_WEIGHTS, PEFT_DIR
from tasks.common import families
from tasks.common.errors import UserError
from tasks.common.genai import BASE_DIR, is_runtime_export
from tasks.common.openvino_model import export_or_none

#: What the model needs to load and predict, pinned to the versions that logged it (MLflow's
#: own inference would load the model in a subprocess just to guess this list).
_RUNTIME_PACKAGES = (
    "mlflow", "torch", "diffusers", "transformers", "accelerate", "peft", "safetensors", "pillow",
    "pandas", "numpy", "optimum", "optimum-intel", "openvino", "openvino-tokenizers", "openvino-genai",
    "av",  # a video model's MP4 (finetune_runtime/model.py)
)


def pip_requirements() -> list[str]:
    reqs = []
    for pkg in _RUNTIME_PACKAGES:
        try:
            reqs.append(f"{pkg}=={importlib.metadata.version(pkg)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return reqs


def model_artifacts(finetuned: Path, openvino: Path, base: Path | None) -> dict[str, str]:
    """The pyfunc's artifacts: the fine-tuned pipeline and its OpenVINO export; for LoRA adapters
    saved without `fuse_lora`, the adapters and the base pipeline they apply to.

    Every train output reaches the registry (docs/registry.md, "The registry", method x export table):
    a full pipeline (dreambooth, full, textual_inversion, lora with fuse_lora) as it is; an
    adapters-only folder (lora, fuse_lora: false) with `base`, loaded by the pyfunc as
    `DiffusionPipeline.from_pretrained(base).load_lora_weights(finetuned)`.
    """
    if is_runtime_export(openvino):  # export.adapters: runtime: the adapter, its base export apart
        if base is None or not (Path(finetuned) / LORA_WEIGHTS).is_file():
            raise UserError(f"{openvino} is a run-time adapter export: register it with the LoRA it was "
                            f"made from (--finetuned holding {LORA_WEIGHTS}) and --base models/base")
        families.read_index(base, "run `dvc repro base` first")
        return {layout.FINETUNED: str(finetuned)}  # the base pipeline is the base export version's
    exported = export_or_none(openvino)  # None: export.enabled false, served by diffusers
    if exported is not None:
        families.read_index(exported, "run the pipeline first (`dvc repro`)")
    artifacts = {layout.FINETUNED: str(finetuned), **({layout.OPENVINO: str(exported)} if exported else {})}
    if layout.is_pipeline(finetuned):  # a full pipeline (LoRA weights beside it: fused)
        return artifacts
    if not ((Path(finetuned) / LORA_WEIGHTS).is_file() or (Path(finetuned) / PEFT_DIR).is_dir()):
        raise UserError(f"{finetuned} holds neither a diffusers pipeline (model_index.json) nor adapters "
                        f"({LORA_WEIGHTS}, {PEFT_DIR}/): run the pipeline first (`dvc repro`)")
    adapters_only = (f"{finetuned} holds LoRA adapters only (train.fuse_lora: false); they are registered "
                     "with the base pipeline they apply to: pass --base models/base (run `dvc repro base` first)")
    if base is None:
        raise UserError(adapters_only)
    families.read_index(base, adapters_only)
    return {**artifacts, layout.BASE: str(base)}


def call_convention(*folders: Path | None) -> dict[str, Any]:
    """How the served model calls its pipeline, from the first pipeline folder among `folders` (the
    fine-tune, the base its adapters apply to, the export or its base): the family's CallConvention
    (finetune_runtime/convention.py) as model_config `pipeline_call`."""
    found = [Path(f) for f in folders if f is not None]
    found += [f / BASE_DIR for f in found]  # a run-time adapter export's base
    folder = next((f for f in found if layout.is_pipeline(f)), None)
    if folder is None:
        raise UserError(f"none of {', '.join(map(str, found))} is a pipeline folder (model_index.json): run the "
                        "pipeline first (`dvc repro`)")
    return {CONFIG_KEY: families.detect(folder).call_convention().as_config()}
