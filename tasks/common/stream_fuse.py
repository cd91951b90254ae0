"""A LoRA or DoRA file fused into a base pipeline's weight files one shard at a time.

diffusers' `fuse_lora` needs the whole pipeline in memory, and `save_pretrained` then writes it:
for FLUX.1-dev that is 24 GB of bf16 weights on a 24 GB machine, after training. Here each
safetensors shard of a component with adapters is read, its adapted weights get the update
(LoRA: `W + s B A`; DoRA: `m / ||W + s B A|| * (W + s B A)`, the row norm, as peft merges it)
computed in float32 and stored back in the shard's own dtype, and the shard is written: the peak
is one shard. model_index.json and the other components are hard-linked. The result is what
`load_lora_weights` + `fuse_lora` + `save_pretrained` writes, up to the last bit of rounding.

`plan()` checks the whole file first: every adapted module must be found in the base's shards
(and no other weight format beside them), with no per-layer rank or alpha patterns and no
convolution DoRA. Otherwise it says why, and the caller fuses in memory instead; nothing has
been written.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.common.outputs import link_tree

log = logging.getLogger(__name__)

# The adapter parts of a LoRA file's keys, in peft's and diffusers' spellings.
_PART = re.compile(r"\.(lora_A|lora_B|lora\.down|lora\.up|lora_linear_layer\.down|lora_linear_layer\.up)"
                   r"\.weight$|\.lora_magnitude_vector(\.weight)?$")
OTHER_WEIGHTS = {".bin", ".pt", ".pth", ".ckpt", ".msgpack", ".h5"}
_ROLE = {"lora_A": "down", "lora.down": "down", "lora_linear_layer.down": "down",
         "lora_B": "up", "lora.up": "up", "lora_linear_layer.up": "up"}


@dataclass
class Layer:
    down: Any = None
    up: Any = None
    magnitude: Any = None


@dataclass
class Plan:
    """Per component: {weight key in its shards: the layer}, and the scale of its layers."""
    layers: dict[str, dict[str, Layer]] = field(default_factory=dict)
    scales: dict[str, float] = field(default_factory=dict)


def _scale(meta: dict[str, Any], component: str) -> tuple[float, str | None]:
    """peft's scale (alpha / r, or alpha / sqrt(r) with rsLoRA) from the file's adapter metadata."""
    cfg = {k.split(".", 1)[1]: v for k, v in meta.items() if k.startswith(component + ".")}
    if not cfg:
        return 1.0, None  # no metadata: diffusers takes alpha = rank
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        return 1.0, f"{component} has per-layer rank or alpha patterns"
    r, alpha = float(cfg["r"]), float(cfg["lora_alpha"])
    return (alpha / r ** 0.5 if cfg.get("use_rslora") else alpha / r), None


def _shard_keys(folder: Path) -> dict[str, Path]:
    from safetensors import safe_open

    keys: dict[str, Path] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(shard, "pt") as fh:
            keys.update({k: shard for k in fh.keys()})  # noqa: SIM118 (safe_open is not a dict)
    return keys


def plan(base: Path, lora_file: Path, components: list[str]) -> tuple[Plan | None, str]:
    """What to fuse where, or (None, why it cannot stream)."""
    from safetensors import safe_open

    with safe_open(lora_file, "pt") as fh:
        meta = json.loads((fh.metadata() or {}).get("lora_adapter_metadata", "{}"))
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118
    result = Plan()
    for key, tensor in tensors.items():
        component, _, rest = key.partition(".")
        part = _PART.search(rest)
        if component not in components or part is None:
            return None, f"{key} is not a LoRA layer of {', '.join(components)}"
        layer = result.layers.setdefault(component, {}).setdefault(rest[:part.start()] + ".weight", Layer())
        if part.group(1) is None:
            layer.magnitude = tensor
        else:
            setattr(layer, _ROLE[part.group(1)], tensor)
    for component, layers in result.layers.items():
        scale, why = _scale(meta, component)
        if why:
            return None, why
        result.scales[component] = scale
        if other := sorted(p.name for p in (base / component).glob("*") if p.suffix in OTHER_WEIGHTS):
            return None, f"{component} also has {other[0]}, which would stay unfused beside the fused shards"
        stored = _shard_keys(base / component)
        missing = [k for k in layers if k not in stored]
        if missing:
            return None, f"{component} has no weight {missing[0]} in its safetensors files"
        if not all(_streamable(lay) for lay in layers.values()):
            return None, f"{component} has a layer that is not a linear LoRA or DoRA, or a 2-D convolution LoRA"
    return result, ""


def _streamable(layer: Layer) -> bool:
    """A linear LoRA or DoRA, or a Conv2d LoRA (down (r, in, kh, kw), up (out, r, 1, 1))."""
    if layer.down is None or layer.up is None:
        return False
    if layer.down.dim() == 2:
        return layer.up.dim() == 2
    return (layer.magnitude is None and layer.down.dim() == 4 and layer.up.dim() == 4
            and tuple(layer.up.shape[2:]) == (1, 1))


def _fused(weight: Any, layer: Layer, scale: float) -> Any:
    import torch

    w = weight.to(torch.float32)
    if layer.down.dim() == 2:
        w = w + scale * (layer.up.to(torch.float32) @ layer.down.to(torch.float32)).reshape(w.shape)
    else:  # a convolution LoRA: down (r, in, kh, kw), up (out, r, 1, 1)
        w = w + scale * torch.einsum("or,rikl->oikl", layer.up.to(torch.float32).flatten(1),
                                     layer.down.to(torch.float32))
    if layer.magnitude is not None:
        w = (layer.magnitude.to(torch.float32) / torch.linalg.norm(w, dim=1)).unsqueeze(1) * w
    return w.to(weight.dtype)


def _link(src: Path, dst: Path) -> None:
    """A base file or folder into the output, by hard links where the filesystem allows; never
    over a file the output already has (FileExistsError)."""
    if src.is_dir():
        link_tree(src, dst)
        return
    try:
        os.link(src, dst)
    except OSError as err:
        if err.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
            raise
        shutil.copy2(src, dst)


def fuse_to(base: Path, out_dir: Path, fuse: Plan) -> dict[str, int]:
    """Write the base pipeline (model_index.json and the components it lists) into `out_dir`, which
    may hold other files (the LoRA file), with `fuse`'s layers fused; returns {component: layers}."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from tasks.common.families import read_index

    _link(base / "model_index.json", out_dir / "model_index.json")
    for name in read_index(base):
        if name not in fuse.layers and (base / name).is_dir():
            _link(base / name, out_dir / name)
    done: dict[str, int] = defaultdict(int)
    for component, layers in fuse.layers.items():
        src, dst = base / component, out_dir / component
        dst.mkdir()
        for entry in src.iterdir():
            if entry.suffix != ".safetensors":
                _link(entry, dst / entry.name)
                continue
            with safe_open(entry, "pt") as fh:
                meta, shard = fh.metadata(), {}
                for key in fh.keys():  # noqa: SIM118 (safe_open is not a dict)
                    shard[key] = fh.get_tensor(key)
                    if key in layers:
                        shard[key] = _fused(shard[key], layers[key], fuse.scales[component])
                        done[component] += 1
            save_file(shard, dst / entry.name, metadata=meta)
            del shard
        log.info("fused %d layers into %s, one shard at a time", done[component], dst)
    return dict(done)
