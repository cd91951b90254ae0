"""The trained adapters as one ComfyUI file (`train.lora_format: comfyui`, SimpleTuner's name).

ComfyUI's loader (comfy/lora.py) finds each layer by a key stem it maps to a model weight, then
reads the adapter type from the suffixes under that stem:

- LoRA: `<stem>.lora_down.weight`, `<stem>.lora_up.weight`, `<stem>.alpha` (a scalar; the update is
  up @ down * alpha / rank, peft's `lora_alpha / r`); DoRA adds `<stem>.dora_scale`, peft's magnitude
  as an (out, 1) column;
- LoHa: `<stem>.hada_w1_a/.hada_w1_b/.hada_w2_a/.hada_w2_b` + alpha (scale alpha / rank, as peft's);
- LoKr: `<stem>.lokr_w1` (or `_a`/`_b`), `<stem>.lokr_w2` (or `_a`/`_b`) + alpha; ComfyUI and LyCORIS
  scale by alpha / rank only when a factor is low-rank (otherwise by 1), so peft's scale is folded
  into `lokr_w1` there (and alpha written as the rank).

The stem is the family's prefix (the family's ExportProfile: comfyui_lora_prefixes, comfyui_lycoris_prefixes) and
the module path: kohya's `lora_unet_<path with _>` for SD/SDXL's UNet, `lora_te_`/`lora_te1_`/
`lora_te2_` for the CLIP encoders, OneTrainer's `lora_transformer_` (SD3, FLUX.1), `diffusion_model.`
with the dotted path (Z-Image, Qwen-Image), kohya's `lora_unet_` with BFL's module names for
FLUX.2 (its q, k and v fused, ExportProfile.comfyui_layers) and LyCORIS' `lycoris_` for LoKr and LoHa
on the DiT families. A family whose prefixes are None (Sana: ComfyUI has no such model) has no
ComfyUI file; the format's spec (tasks/common/adapter_formats.py) refuses it before training.
tasks/train/README.md ("ComfyUI adapter file") says what loads where, and from which ComfyUI build.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tasks.common.adapters import adapter_type

#: the file the train stage writes beside its other outputs with `lora_format: comfyui`
COMFYUI_LORA_NAME = "comfyui_lora.safetensors"

#: peft's key suffix (get_peft_model_state_dict) -> ComfyUI's
SUFFIXES = {"lora_A.weight": "lora_down.weight", "lora_B.weight": "lora_up.weight",
            "lora_magnitude_vector": "dora_scale",
            **{s: s for s in ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2",
                              "lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2")}}


def network_module(lora_type: str) -> str:
    """kohya's `ss_network_module` of an adapter type (LyCORIS' kohya network for LoKr and LoHa)."""
    return "lycoris.kohya" if adapter_type(lora_type).lycoris else "networks.lora"


def stem(prefix: str, path: str) -> str:
    """ComfyUI's key stem of the module at `path` (dotted) under `prefix`. The CLIP encoders' layers
    are named as in the original checkpoints, `text_model.encoder.layers.<n>` (kohya's and ComfyUI's
    `lora_te_text_model_encoder_layers_<n>_...`): transformers 5's CLIPTextModel has no `text_model` level."""
    if prefix.startswith("lora_te") and path.startswith("encoder."):
        path = "text_model." + path
    return prefix + (path.replace(".", "_") if prefix.endswith("_") else path)


def prefixes(family: Any, lora_type: str) -> dict[str, str]:
    """Each component's key prefix for `lora_type` in `family`'s ComfyUI file."""
    if (found := family.export.comfyui_prefixes(lora_type)) is None:
        raise ValueError(f"{family.title}: no ComfyUI key prefixes (ComfyUI has no {family.title} model); "
                         "set train.lora_format: diffusers")
    return found


def split_key(key: str) -> tuple[str, str]:
    """(module path, ComfyUI suffix) of one peft adapter key."""
    for peft_suffix, suffix in SUFFIXES.items():
        if key.endswith("." + peft_suffix):
            return key[: -len(peft_suffix) - 1], suffix
    raise ValueError(f"{key}: not a LoRA, DoRA, LoKr or LoHa tensor ComfyUI reads")


def peft_layers(module: Any) -> dict[str, dict[str, Any]]:
    """One component's adapters (peft's `default`) by module path, under ComfyUI's suffixes, in
    float32, each with its alpha (see the module's docstring for LoKr's)."""
    from peft.utils import get_peft_model_state_dict

    config = module.peft_config["default"]
    rank = float(config.r)
    alpha = float(getattr(config, "lora_alpha", None) or getattr(config, "alpha", None) or rank)
    layers: dict[str, dict[str, Any]] = {}
    for key, tensor in get_peft_model_state_dict(module).items():
        path, suffix = split_key(key)
        layers.setdefault(path, {})[suffix] = tensor.detach().float().contiguous()
    for tensors in layers.values():
        if "dora_scale" in tensors:  # peft's (out,) magnitude; kohya's and ComfyUI's output-axis column
            tensors["dora_scale"] = tensors["dora_scale"].reshape(-1, 1)
        low_rank = any(k in tensors for k in ("lora_down.weight", "hada_w1_a", "lokr_w1_a", "lokr_w2_a"))
        if not low_rank:  # a LoKr of two full factors: ComfyUI and LyCORIS apply it unscaled
            tensors["lokr_w1"] = tensors["lokr_w1"] * (alpha / rank)
        # (LyCORIS reads an alpha for every layer: the full LoKr's, rank, is one whatever the reader)
        tensors["alpha"] = tensors[next(iter(tensors))].new_tensor(alpha if low_rank else rank)
    return layers


def comfyui_state(family: Any, modules: dict[str, Any], lora_type: str) -> dict[str, Any]:
    """The adapters of `modules` (component name -> model with peft adapters) as ComfyUI's state dict."""
    names = prefixes(family, lora_type)
    if missing := sorted(set(modules) - set(names)):
        raise ValueError(f"{family.title}: no ComfyUI key prefix for {', '.join(missing)}")
    state: dict[str, Any] = {}
    for name, module in modules.items():
        layers = family.export.comfyui_layers(name, peft_layers(module))
        state.update({f"{stem(names[name], path)}.{suffix}": t for path, tensors in layers.items()
                      for suffix, t in tensors.items()})
    return state


def metadata(family: Any, lora_type: str, rank: int, alpha: float | None) -> dict[str, str]:
    """kohya's safetensors metadata (what kohya's and LyCORIS' tools and LoRA managers read; ComfyUI's
    loader needs none of it) and the family."""
    meta = {"ss_network_module": network_module(lora_type), "ss_network_dim": str(rank),
            "ss_network_alpha": str(float(alpha or rank)), "ss_base_model_version": family.name,
            "modelspec.architecture": f"{family.name}/{lora_type}", "format": "pt"}
    if (args := adapter_type(lora_type).network_args) is not None:
        meta["ss_network_args"] = json.dumps(args)
    return meta


def write_comfyui_lora(path: Path, family: Any, modules: dict[str, Any], lora_type: str, rank: int,
                       alpha: float | None) -> int:
    """Write the ComfyUI file to `path`; returns its number of adapted layers."""
    from safetensors.torch import save_file

    state = comfyui_state(family, modules, lora_type)
    save_file(state, str(path), metadata=metadata(family, lora_type, rank, alpha))
    return sum(key.endswith((".lora_down.weight", ".hada_w1_a", ".lokr_w1", ".lokr_w1_a")) for key in state)
