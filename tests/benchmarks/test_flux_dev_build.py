"""benchmarks/flux_dev/build.py writes a transformer it never holds: sharded, indexed, loadable by
diffusers, every tensor drawn as PyTorch's default init draws it."""
from __future__ import annotations

import json
import math

import torch

TINY = dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16, guidance_embeds=True,
            axes_dims_rope=(4, 6, 6))


def test_the_streamed_transformer_is_sharded_indexed_and_loads_with_diffusers(tmp_path, monkeypatch) -> None:
    from diffusers import FluxTransformer2DModel

    from benchmarks.flux_dev import build

    monkeypatch.setattr(build, "SHARD_BYTES", 50_000)
    params = build.save_transformer(tmp_path, seed=0, config=TINY)
    folder = tmp_path / "transformer"
    index = json.loads((folder / "diffusion_pytorch_model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 2 and all((folder / name).is_file() for name in shards)
    model = FluxTransformer2DModel.from_pretrained(folder)
    assert sum(p.numel() for p in model.parameters()) == params == sum(
        p.numel() for p in FluxTransformer2DModel(**TINY).parameters())
    assert set(index["weight_map"]) == set(model.state_dict())
    from safetensors.torch import load_file

    assert {t.dtype for name in shards for t in load_file(folder / name).values()} == {torch.bfloat16}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            bound = 1 / math.sqrt(module.in_features)
            assert module.weight.abs().max() <= bound * 1.01 and module.weight.std() > bound / 4, name  # bf16
        elif hasattr(module, "weight") and module.weight is not None and module.weight.dim() == 1:
            assert torch.all(module.weight == 1), name  # norms
