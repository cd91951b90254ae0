"""Adapter types beyond plain LoRA (`train.lora_type`), as peft builds them, and their files.

- `lora`, `dora` (weight-decomposed LoRA, peft's `use_dora`): diffusers' LoRA file
  (`pytorch_lora_weights.safetensors`), which every family's `load_lora_weights` reads;
- `lokr` (Kronecker product), `loha` (Hadamard product): diffusers has no loader for them, so they
  are saved in peft's own layout, one folder per adapted component under `peft_adapters/`
  (`adapter_config.json` + `adapter_model.safetensors`, what `PeftModel.save_pretrained` writes),
  and applied back through peft (`apply_peft_adapters`).

The train stage builds the configs; the export and evaluate stages (tasks/common/finetuned.py)
and the LoRA method's fused output apply and fuse the peft folders.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

ADAPTER_TYPES = ("lora", "dora", "lokr", "loha")
#: the types saved as diffusers' LoRA file; the others in peft's layout under PEFT_DIR
DIFFUSERS_FORMAT = ("lora", "dora")
PEFT_DIR = "peft_adapters"
CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"


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
        state = {k: v.detach().contiguous() for k, v in get_peft_model_state_dict(module).items()}
        save_file(state, str(out / WEIGHTS_NAME), metadata={"format": "pt"})


def peft_components(folder: Path) -> list[str]:
    """The components a peft adapters folder has adapters for."""
    if not Path(folder).is_dir():
        return []
    return sorted(p.name for p in Path(folder).iterdir() if (p / CONFIG_NAME).is_file())


def apply_peft_adapters(pipe: Any, folder: Path, fuse: bool = True) -> list[str]:
    """Put the adapters of `folder` (save_peft_adapters' layout) on the pipeline's components; with
    `fuse`, merge them into the weights and drop the adapter layers. Returns the components."""
    from diffusers.utils.peft_utils import recurse_remove_peft_layers
    from peft import PeftConfig, inject_adapter_in_model, set_peft_model_state_dict
    from peft.tuners.tuners_utils import BaseTunerLayer
    from safetensors.torch import load_file

    names = peft_components(folder)
    for name in names:
        module = getattr(pipe, name, None)
        if module is None:
            raise ValueError(f"{folder / name} holds adapters for {name!r}, which the pipeline does not have")
        config = PeftConfig.from_pretrained(str(Path(folder) / name))
        inject_adapter_in_model(config, module, adapter_name="default")
        result = set_peft_model_state_dict(module, load_file(str(Path(folder) / name / WEIGHTS_NAME)),
                                           adapter_name="default")
        if unexpected := getattr(result, "unexpected_keys", None):
            raise ValueError(f"{folder / name}: {len(unexpected)} adapter tensors match no layer, e.g. {unexpected[0]}")
        if fuse:
            for layer in module.modules():
                if isinstance(layer, BaseTunerLayer):
                    layer.merge()
            recurse_remove_peft_layers(module)
            if hasattr(module, "peft_config"):
                del module.peft_config  # plain weights again: nothing may save it as an adapter model
    log.info("applied peft adapters (%s) from %s%s", ", ".join(names), folder, ", fused" if fuse else "")
    return names
