"""Adapter types beyond plain LoRA (`train.lora_type`), as peft builds them, and their files.

- `lora`, `dora` (weight-decomposed LoRA, peft's `use_dora`): diffusers' LoRA file
  (`pytorch_lora_weights.safetensors`), which every family's `load_lora_weights` reads;
- `lokr` (Kronecker product), `loha` (Hadamard product): diffusers has no loader for them, so they
  are saved in peft's own layout, one folder per adapted component under `peft_adapters/`
  (`adapter_config.json` + `adapter_model.safetensors`, what `PeftModel.save_pretrained` writes):
  `PeftModel.from_pretrained(pipe.unet, "peft_adapters/unet")` loads one (`apply_peft_adapters`).

The train stage builds the configs; the export and evaluate stages (tasks/common/finetuned.py)
and the LoRA method's fused output apply and fuse the peft folders. With `train.lora_format:
comfyui` any of the four is also written as one file under ComfyUI's keys (tasks/common/comfyui_lora.py).
"""
from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

ADAPTER_TYPES = ("lora", "dora", "lokr", "loha")
#: the types saved as diffusers' LoRA file; the others in peft's layout under PEFT_DIR
DIFFUSERS_FORMAT = ("lora", "dora")
#: the types OpenVINO GenAI applies at run time (`export.adapters: runtime`): plain LoRA only
RUNTIME_TYPES = ("lora",)
PEFT_DIR = "peft_adapters"
CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
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


def peft_components(folder: Path) -> list[str]:
    """The components a peft adapters folder has adapters for."""
    if not Path(folder).is_dir():
        return []
    return sorted(p.name for p in Path(folder).iterdir() if (p / CONFIG_NAME).is_file())


def apply_peft_adapters(pipe: Any, folder: Path, merge: bool = True) -> list[str]:
    """Fuse the adapters of `folder` (save_peft_adapters' layout) into the pipeline's components
    through peft's own loader (`PeftModel.from_pretrained(...).merge_and_unload()`); returns the
    components. `merge` false: peft's adapter layers stay in the components, unfused (over a quantized
    base). An adapter file whose tensors do not all load is refused, not half-applied."""
    from peft import PeftModel

    names = peft_components(folder)
    for name in names:
        module = getattr(pipe, name, None)
        if module is None:
            raise ValueError(f"{folder / name} holds adapters for {name!r}, which the pipeline does not have")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = PeftModel.from_pretrained(module, str(Path(folder) / name))
        if missing := [w for w in caught if "missing adapter keys" in str(w.message)]:
            raise ValueError(f"{folder / name}: its adapter tensors do not match the {name} layers "
                             f"({str(missing[0].message)[:200]})")
        setattr(pipe, name, model.merge_and_unload() if merge else model.get_base_model())
    log.info("%s peft adapters (%s) from %s", "fused" if merge else "applied", ", ".join(names), folder)
    return names
