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

Each type is an `AdapterType` record in `TYPES` (finetune_runtime/registry.py): code asks its record
(`adapter_type(cfg.lora_type).diffusers_file`, `.runtime`, `.lycoris`), never compares its name. A new
type is one record, `TYPES.register(AdapterType(...))`, before tasks.train.config is imported.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune_runtime.layout import PEFT_CONFIG as CONFIG_NAME
from finetune_runtime.layout import PEFT_WEIGHTS as WEIGHTS_NAME
from finetune_runtime.registry import Registry

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class AdapterType:
    """One `train.lora_type`: how peft builds it, how it is saved and who can read it."""

    name: str
    #: how a version's description writes it (LoRA, DoRA, LoKr, LoHa)
    title: str
    #: peft's config for it: (rank, alpha, dropout, targets, decompose_factor) -> config (peft imported inside)
    peft_config: Callable[..., Any]
    #: saved as diffusers' LoRA file (what every family's load_lora_weights reads); else in peft's
    #: layout under PEFT_DIR. It also has LoRA's dropout (peft's LoraConfig, the one with a dropout)
    diffusers_file: bool = False
    #: OpenVINO GenAI applies it at run time (`export.adapters: runtime`)
    runtime: bool = False
    #: a LyCORIS type (kohya's network module lycoris.kohya, LyCORIS' ComfyUI key prefixes)
    lycoris: bool = False
    #: it reads train.decompose_factor (LoKr's Kronecker factor)
    decompose_factor: bool = False
    #: kohya's `ss_network_args` in the ComfyUI file's metadata (None: none)
    network_args: dict[str, Any] | None = None


def _lora_config(dora: bool) -> Callable[..., Any]:
    def config(rank: int, alpha: float, dropout: float, targets: list[str], decompose_factor: int) -> Any:
        from peft import LoraConfig

        return LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, init_lora_weights="gaussian",
                          target_modules=targets, use_dora=dora)
    return config


def _lokr_config(rank: int, alpha: float, dropout: float, targets: list[str], decompose_factor: int) -> Any:
    from peft import LoKrConfig

    return LoKrConfig(r=rank, alpha=alpha, target_modules=targets, decompose_factor=decompose_factor)


def _loha_config(rank: int, alpha: float, dropout: float, targets: list[str], decompose_factor: int) -> Any:
    from peft import LoHaConfig

    return LoHaConfig(r=rank, alpha=alpha, target_modules=targets)


#: every adapter type, in the order the parameter reference lists them (finetune_runtime/registry.py).
#: One registered after tasks.train.config is imported is not a train.lora_type value (its choices are
#: fixed then), as with a method's options.
TYPES: Registry[AdapterType] = Registry("adapter type", (
    AdapterType("lora", "LoRA", _lora_config(dora=False), diffusers_file=True, runtime=True),
    AdapterType("dora", "DoRA", _lora_config(dora=True), diffusers_file=True, network_args={"dora_wd": True}),
    AdapterType("lokr", "LoKr", _lokr_config, lycoris=True, decompose_factor=True, network_args={"algo": "lokr"}),
    AdapterType("loha", "LoHa", _loha_config, lycoris=True, network_args={"algo": "loha"}),
))
PREFIX = "base_model.model."


def adapter_type(name: str) -> AdapterType:
    """The adapter type called `name`, or a ValueError naming the known ones."""
    return TYPES.get(name)


def names_where(test: Callable[[AdapterType], bool]) -> tuple[str, ...]:
    """The adapter types for which `test(type)` holds, e.g. `names_where(lambda t: t.runtime)`."""
    return tuple(t.name for t in TYPES.where(test))


def peft_config(lora_type: str, rank: int, alpha: float | None, dropout: float, targets: list[str],
                decompose_factor: int = -1) -> Any:
    """peft's config for one adapter type on `targets` (module names)."""
    if lora_type not in TYPES:
        raise ValueError(f"lora_type: {lora_type!r} is not one of {', '.join(TYPES.names())}")
    return adapter_type(lora_type).peft_config(rank, alpha or rank, dropout, targets, decompose_factor)


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
