"""Adapter types beyond plain LoRA (`train.lora_type`), as peft builds them, and their files.

- `lora`, `dora` (weight-decomposed LoRA, peft's `use_dora`): diffusers' LoRA file
  (`pytorch_lora_weights.safetensors`), which every family's `load_lora_weights` reads;
- `lokr` (Kronecker product), `loha` (Hadamard product): diffusers has no loader for them, so they
  are saved in peft's own layout, one folder per adapted component under `peft_adapters/`
  (`adapter_config.json` + `adapter_model.safetensors`, what `PeftModel.save_pretrained` writes):
  `PeftModel.from_pretrained(pipe.unet, "peft_adapters/unet")` loads one
  (finetune_runtime/adapters.py `apply_peft`, for the stages and the served model alike).

The train stage builds the configs and saves the folders here. With `train.lora_format:
comfyui` any of the four is also written as one file under ComfyUI's keys (tasks/common/comfyui_lora.py).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from finetune_runtime.layout import PEFT_CONFIG as CONFIG_NAME
from finetune_runtime.layout import PEFT_WEIGHTS as WEIGHTS_NAME

log = logging.getLogger(__name__)

ADAPTER_TYPES = ("lora", "dora", "lokr", "loha")
#: the types saved as diffusers' LoRA file; the others in peft's layout under PEFT_DIR
DIFFUSERS_FORMAT = ("lora", "dora")
#: the types OpenVINO GenAI applies at run time (`export.adapters: runtime`): plain LoRA only
RUNTIME_TYPES = ("lora",)
PREFIX = "base_model.model."


def peft_config(lora_type: str, rank: int, alpha: float | None, dropout: float, targets: list[str],
                decompose_factor: int = -1) -> Any:
    """peft's config for one adapter type on `targets` (module names)."""
    from peft import LoHaConfig, LoKrConfig, LoraConfig

    alpha = alpha or rank
    if lora_type in DIFFUSERS_FORMAT:
        return LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, init_lora_weights="gaussian",
                          target_modules=targets, use_dora=lora_type == "dora")
    if lora_type == "lokr":
        return LoKrConfig(r=rank, alpha=alpha, target_modules=targets, decompose_factor=decompose_factor)
    if lora_type == "loha":
        return LoHaConfig(r=rank, alpha=alpha, target_modules=targets)
    raise ValueError(f"lora_type: {lora_type!r} is not one of {', '.join(ADAPTER_TYPES)}")


def save_peft_adapters(folder: Path, modules: dict[str, Any]) -> None:
    """Each module's adapter (peft's `default`) in peft's layout: `folder/<component>/`."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    for name, module in modules.items():
        out = Path(folder) / name
        out.mkdir(parents=True, exist_ok=True)
        config = module.peft_config["default"].to_dict()
        # peft keeps target_modules as a set: sorted, or the file's bytes vary with the hash seed.
        config = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}
        (out / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True, default=str))
        # PeftModel's key prefix: what `PeftModel.from_pretrained(component, folder)` loads.
        state = {f"{PREFIX}{k}": v.detach().contiguous() for k, v in get_peft_model_state_dict(module).items()}
        save_file(state, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
