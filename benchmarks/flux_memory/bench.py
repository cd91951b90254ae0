"""What fine-tuning FLUX.1 (12B) needs in memory, from measured per-layer figures.

FLUX.1 cannot train on a 24 GB CPU machine, so this measures what decides its memory and adds it up:

- parameters: the real FluxTransformer2DModel from FLUX.1-dev's published config, built on the
  meta device (no memory), counted exactly; LoRA parameters counted the same way after peft adds
  adapters (rank r on the attention projections, as train.method lora does);
- activations: one real double-stream block (FluxTransformerBlock) and one real single-stream block
  (FluxSingleTransformerBlock) at full width, random bf16 weights, forward at 512 and 1024 px; every
  tensor autograd keeps for the backward pass is counted as it is saved (saved_tensors_hooks),
  which is the activation memory of that block at that size, exactly; with gradient checkpointing a
  block keeps only its inputs, and one block's activations exist at a time during the backward.

Then, per method and precision: weights + gradients + optimizer states + activations, for batch 1.
Not counted: the CUDA context and allocator slack (1-3 GB on a GPU), the VAE and text encoders
(latents and text embeddings are cached, and the encoders released before the first step: see
tasks/train/README.md), dataloader buffers.

    .venv/bin/python benchmarks/flux_memory/bench.py [--resolutions 512 1024] [--rank 16] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

#: black-forest-labs/FLUX.1-dev transformer/config.json (published)
FLUX_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                axes_dims_rope=(16, 56, 56))
TEXT_TOKENS = 512  # FLUX.1-dev's max_sequence_length
GB = 1024 ** 3


def count_parameters(rank: int) -> dict[str, int]:
    """Transformer parameters, and LoRA parameters at `rank` on the attention projections."""
    from diffusers import FluxTransformer2DModel
    from peft import LoraConfig

    with torch.device("meta"):
        model = FluxTransformer2DModel(**FLUX_DEV)
        total = sum(p.numel() for p in model.parameters())
        model.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=["to_k", "to_q", "to_v", "to_out.0"]))
        lora = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    return {"transformer": total, "lora": lora, "double_blocks": FLUX_DEV["num_layers"],
            "single_blocks": FLUX_DEV["num_single_layers"]}


def saved_bytes(block: torch.nn.Module, image_tokens: int, dtype: torch.dtype) -> tuple[int, float]:
    """Bytes autograd saves for the backward of one forward of `block` (batch 1), and its seconds."""
    from diffusers.models.embeddings import FluxPosEmbed

    dim = FLUX_DEV["num_attention_heads"] * FLUX_DEV["attention_head_dim"]
    hidden = torch.randn(1, image_tokens, dim, dtype=dtype, requires_grad=True)
    text = torch.randn(1, TEXT_TOKENS, dim, dtype=dtype, requires_grad=True)
    temb = torch.randn(1, dim, dtype=dtype)
    ids = torch.zeros(TEXT_TOKENS + image_tokens, 3)
    rotary = FluxPosEmbed(theta=10000, axes_dim=list(FLUX_DEV["axes_dims_rope"]))(ids)
    seen: dict[int, int] = {}
    weights = {p.untyped_storage().data_ptr() for p in block.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        # Count each storage once (views of one tensor share it); weights (linear layers save
        # their transposed weight, a view of the parameter) are not activations.
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(hidden, text, temb, rotary)
    return sum(seen.values()), time.perf_counter() - start


def measure_blocks(resolutions: list[int]) -> dict[str, dict[str, float]]:
    from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock, FluxTransformerBlock

    dim = FLUX_DEV["num_attention_heads"] * FLUX_DEV["attention_head_dim"]
    heads, head_dim = FLUX_DEV["num_attention_heads"], FLUX_DEV["attention_head_dim"]
    torch.manual_seed(0)
    blocks = {"double": FluxTransformerBlock(dim, heads, head_dim).to(torch.bfloat16),
              "single": FluxSingleTransformerBlock(dim, heads, head_dim).to(torch.bfloat16)}
    out: dict[str, dict[str, float]] = {}
    for px in resolutions:
        tokens = (px // 16) ** 2  # 8x VAE, then 2x2 packing
        row: dict[str, float] = {"image_tokens": tokens, "text_tokens": TEXT_TOKENS,
                                 "block_input_gb": 2 * (tokens + TEXT_TOKENS) * dim * 2 / GB}
        for kind, block in blocks.items():
            size, seconds = saved_bytes(block, tokens, torch.bfloat16)
            row[f"{kind}_block_activations_gb"] = size / GB
            row[f"{kind}_block_forward_s"] = round(seconds, 2)
        out[str(px)] = row
    return out


def budget(params: dict[str, int], acts: dict[str, float]) -> dict[str, dict[str, float]]:
    """GB per method and precision at batch 1 (see the module docstring for what is left out)."""
    n, lora = params["transformer"], params["lora"]
    d, s = params["double_blocks"], params["single_blocks"]
    full_acts = d * acts["double_block_activations_gb"] + s * acts["single_block_activations_gb"]
    ckpt_acts = (d + s) * acts["block_input_gb"] + max(acts["double_block_activations_gb"],
                                                       acts["single_block_activations_gb"])
    rows = {
        # frozen base in bf16 (2 B), adapters fp32 with grads and AdamW moments (16 B)
        "lora bf16 base": (2 * n + 16 * lora) / GB,
        # base in 8 bit (1 B per weight, as bitsandbytes/torchao quantized LoRA does)
        "lora int8 base": (1 * n + 16 * lora) / GB,
        # every weight fp32, fp32 grads, AdamW moments fp32 (16 B)
        "full fp32 AdamW": 16 * n / GB,
        # bf16 weights and grads, AdamW moments in 8 bit (2 + 2 + 2 B)
        "full bf16 + 8-bit AdamW": 6 * n / GB,
    }
    return {name: {"states_gb": round(gb, 1), "with_activations_gb": round(gb + full_acts, 1),
                   "with_checkpointing_gb": round(gb + ckpt_acts, 1)} for name, gb in rows.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--resolutions", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("results.json"))
    args = parser.parse_args()
    torch.set_grad_enabled(True)
    params = count_parameters(args.rank)
    blocks = measure_blocks(args.resolutions)
    result = {"config": "black-forest-labs/FLUX.1-dev transformer", "lora_rank": args.rank, "parameters": params,
              "per_block": blocks, "budget_gb": {px: budget(params, row) for px, row in blocks.items()}}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
