"""What a registered version carries: its artifacts, the packages it pins, how it calls its pipeline.

`model_artifacts` decides which folders a version logs for each train output and export (README
"The registry", method x export table); `call_convention` what the served model's config records
about its family's pipeline call; `pip_requirements` the versions that logged it.
"""
from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import Any

from tasks.common import families
from tasks.common.adapters import PEFT_DIR
from tasks.common.errors import UserError
from tasks.common.genai import BASE_DIR, is_runtime_export
from tasks.common.openvino_model import export_or_none

#: What the train stage writes for `train.method: lora` (tasks/train/methods/lora.py); without
#: `fuse_lora` the folder holds only this file (LoKr and LoHa: peft's folders under PEFT_DIR),
#: and the model is registered with its base.
from tasks.register.diffusers_flavor import LORA_WEIGHTS

#: What the model needs to load and predict, pinned to the versions that logged it (MLflow's
#: own inference would load the model in a subprocess just to guess this list).
_RUNTIME_PACKAGES = (
    "mlflow", "torch", "diffusers", "transformers", "accelerate", "peft", "safetensors", "pillow",
    "pandas", "numpy", "optimum", "optimum-intel", "openvino", "openvino-tokenizers", "openvino-genai",
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

    Every train output reaches the registry (README "The registry", method x export table):
    a full pipeline (dreambooth, full, textual_inversion, lora with fuse_lora) as it is; an
    adapters-only folder (lora, fuse_lora: false) with `base`, loaded by the pyfunc as
    `DiffusionPipeline.from_pretrained(base).load_lora_weights(finetuned)`.
    """
    if is_runtime_export(openvino):  # export.adapters: runtime: the adapter, its base export apart
        if base is None or not (Path(finetuned) / LORA_WEIGHTS).is_file():
            raise UserError(f"{openvino} is a run-time adapter export: register it with the LoRA it was "
                            f"made from (--finetuned holding {LORA_WEIGHTS}) and --base models/base")
        families.read_index(base, "run `dvc repro base` first")
        return {"finetuned": str(finetuned)}  # the base pipeline is the base export version's
    exported = export_or_none(openvino)  # None: export.enabled false, served by diffusers
    if exported is not None:
        families.read_index(exported, "run the pipeline first (`dvc repro`)")
    artifacts = {"finetuned": str(finetuned), **({"openvino": str(exported)} if exported else {})}
    if (Path(finetuned) / "model_index.json").is_file():  # a full pipeline (LoRA weights beside it: fused)
        return artifacts
    if not ((Path(finetuned) / LORA_WEIGHTS).is_file() or (Path(finetuned) / PEFT_DIR).is_dir()):
        raise UserError(f"{finetuned} holds neither a diffusers pipeline (model_index.json) nor adapters "
                        f"({LORA_WEIGHTS}, {PEFT_DIR}/): run the pipeline first (`dvc repro`)")
    adapters_only = (f"{finetuned} holds LoRA adapters only (train.fuse_lora: false); they are registered "
                     "with the base pipeline they apply to: pass --base models/base (run `dvc repro base` first)")
    if base is None:
        raise UserError(adapters_only)
    families.read_index(base, adapters_only)
    return {**artifacts, "base": str(base)}


#: Input images a request may send to a model whose family edits (its `image` param): each one's
#: tokens join every denoising step, so they are bounded like the images asked for
SERVED_INPUT_IMAGES = 4


def call_convention(*folders: Path | None) -> dict[str, Any]:
    """How the served model calls its pipeline, from the first pipeline folder among `folders` (the
    fine-tune, the base its adapters apply to, the export or its base): the family's convention
    (ModelFamily.call_convention) as model_config `pipeline_call`, and `input_images`, how many
    input images a request may send (0 where the family does not edit)."""
    found = [Path(f) for f in folders if f is not None]
    found += [f / BASE_DIR for f in found]  # a run-time adapter export's base
    folder = next((f for f in found if (f / "model_index.json").is_file()), None)
    if folder is None:
        raise UserError(f"none of {', '.join(map(str, found))} is a pipeline folder (model_index.json): run the "
                        "pipeline first (`dvc repro`)")
    family = families.detect(folder)
    return {"pipeline_call": family.call_convention(),
            "input_images": SERVED_INPUT_IMAGES if family.takes_references else 0}
