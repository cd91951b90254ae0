"""FLUX.1-dev's architecture with seeded random weights, saved as a diffusers folder, never whole in memory.

Every config value is the published one of black-forest-labs/FLUX.1-dev: the 11.9B-parameter
FluxTransformer2DModel (19 double-stream and 38 single-stream blocks, 3072 wide, guidance
embedding), the 16-channel VAE (scaling 0.3611, shift 0.1159), CLIP ViT-L/14 and T5-v1.1-XXL
(4.76B) text encoders, and the flow-matching scheduler with dynamic shifting. Nothing is downloaded.

The transformer is 22.2 GB (GiB) in bf16, nearly all of this machine's memory, so it is not built as a
module: its tensors are drawn one at a time from the distribution PyTorch's default init gives
them (Linear and Conv weights and biases uniform in +-1/sqrt(fan_in), norm weights 1, norm biases
0) and written in 2 GB shards with a safetensors index, as `save_pretrained(max_shard_size=...)`
writes them. Peak memory is one shard. The other parts are built as modules (benchmarks/sd35/build.py,
T5-XXL at 9.5 GB is the largest). The tokenizers are the project's locally made ones.

    .venv/bin/python -m benchmarks.flux_dev.build --out .cache/bench/flux1-dev      # 32 GB (GiB) on disk
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.flux_memory.bench import FLUX_DEV
from benchmarks.sd35.build import CLIP_L, T5_XXL, VAE, _save, finish

log = logging.getLogger("benchmarks.flux_dev")

#: black-forest-labs/FLUX.1-dev vae/config.json: SD3's VAE with FLUX's latent scale and shift
FLUX_VAE = {**VAE, "scaling_factor": 0.3611, "shift_factor": 0.1159}
#: scheduler/scheduler_config.json
SCHEDULER = dict(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                 max_image_seq_len=4096)
SHARD_BYTES = 2 * 1024 ** 3


def _init(module: Any, leaf: str, shape: tuple[int, ...], generator: Any) -> Any:
    """One tensor drawn as PyTorch's default init of its module draws it, in bf16."""
    import torch

    if isinstance(module, (torch.nn.Linear, torch.nn.Conv2d)):
        fan_in = math.prod(module.weight.shape[1:])
        bound = 1 / math.sqrt(fan_in)
        return torch.empty(shape, dtype=torch.bfloat16).uniform_(-bound, bound, generator=generator)
    fill = 1.0 if leaf == "weight" else 0.0  # LayerNorm / RMSNorm / GroupNorm
    return torch.full(shape, fill, dtype=torch.bfloat16)


def _shards(model: Any) -> list[list[str]]:
    """The state dict's names in file order, cut into shards of at most SHARD_BYTES of bf16."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, tensor in model.state_dict().items():
        nbytes = tensor.numel() * 2
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _tensors(model: Any, names: list[str], generator: Any) -> Iterator[tuple[str, Any]]:
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    for name in names:
        owner, _, leaf = name.rpartition(".")
        yield name, _init(model.get_submodule(owner), leaf, shapes[name], generator)


def save_transformer(out: Path, seed: int, config: dict[str, Any] | None = None,
                     cls_name: str = "FluxTransformer2DModel") -> int:
    """Write transformer/ (config.json, shards, index) without holding the model; returns its parameters.
    `cls_name`: the diffusers transformer class (FLUX.2 [klein]: Flux2Transformer2DModel)."""
    import diffusers
    import torch
    from accelerate import init_empty_weights
    from safetensors.torch import save_file

    with init_empty_weights():
        model = getattr(diffusers, cls_name)(**(config or FLUX_DEV))
    folder = out / "transformer"
    folder.mkdir(parents=True, exist_ok=True)
    model.save_config(folder)
    generator = torch.Generator().manual_seed(seed)
    shards = _shards(model)
    weight_map: dict[str, str] = {}
    total = 0
    start = time.perf_counter()
    for i, names in enumerate(shards, 1):
        file = f"diffusion_pytorch_model-{i:05d}-of-{len(shards):05d}.safetensors"
        tensors = dict(_tensors(model, names, generator))
        total += sum(t.numel() for t in tensors.values())
        save_file(tensors, folder / file, metadata={"format": "pt"})
        del tensors
        weight_map.update(dict.fromkeys(names, file))
        log.info("transformer shard %d/%d written (%.0f s)", i, len(shards), time.perf_counter() - start)
    index = {"metadata": {"total_size": total * 2}, "weight_map": weight_map}
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return total


def build_flux_dev(out: Path, seed: int = 0, t5_layers: int | None = None) -> dict[str, int]:
    """Write the pipeline folder; returns parameters per component."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from tasks.common.families.tiny import clip_tokenizer, t5_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    clip = {k: v for k, v in CLIP_L.items() if k != "projection_dim"}
    t5 = {**T5_XXL, **({"num_layers": t5_layers} if t5_layers else {})}
    index: dict[str, Any] = {"_class_name": "FluxPipeline", "_diffusers_version": "0.40.0"}
    params = {"transformer": save_transformer(out, seed)}
    index["transformer"] = ["diffusers", "FluxTransformer2DModel"]
    parts = {"vae": lambda: AutoencoderKL(**FLUX_VAE),
             "text_encoder": lambda: CLIPTextModel(CLIPTextConfig(**clip)),
             "text_encoder_2": lambda: T5EncoderModel(T5Config(**t5))}
    for i, (name, build) in enumerate(parts.items(), 1):
        library, cls, params[name] = _save(name, build, out, seed + i)
        index[name] = [library, cls]
    tokenizers = {"tokenizer": clip_tokenizer()[0], "tokenizer_2": t5_tokenizer(max_length=512)}
    return finish(out, index, tokenizers, FlowMatchEulerDiscreteScheduler(**SCHEDULER), params)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(".cache/bench/flux1-dev"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--t5-layers", type=int, help="fewer T5 encoder layers than the published 24")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if (args.out / "parameters.json").is_file():
        log.info("%s is built already", args.out)
        return
    print(json.dumps(build_flux_dev(args.out, args.seed, args.t5_layers), indent=2))


if __name__ == "__main__":
    main()
