"""FLUX.2 [klein] 4B's architecture with seeded random weights, saved as a diffusers folder.

Every config value is the published one of black-forest-labs/FLUX.2-klein-4B (the distilled
release, as `builtin:tiny-flux2` is): the 3.88B-parameter Flux2Transformer2DModel (5 double-stream
and 20 single-stream blocks, 24 heads of 128, joint attention over 3 x 2560 Qwen3 features, no
guidance embedding), the 32-channel AutoencoderKLFlux2 with its batch-norm latent statistics,
Qwen3-4B (36 layers, 2560 wide, 32 query and 8 key/value heads of 128, 151,936 tokens, tied
embeddings) as the text encoder, and the flow-matching scheduler with dynamic shifting. Nothing is
downloaded; the tokenizer is the project's locally learned Qwen byte-level BPE (its ids are a subset
of the embedding's 151,936 rows, so the encoder's size is the real one).

The transformer is written tensor by tensor in 2 GB shards (benchmarks/flux_dev/build.py), Qwen3-4B
is built as a module in bf16 (7.5 GiB resident while it is saved).

    .venv/bin/python -m benchmarks.flux2_klein.build --out .cache/bench/flux2-klein-4b    # 15 GB (GiB) on disk
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from benchmarks.flux_dev.build import save_transformer
from benchmarks.sd35.build import _save, build_command, finish

log = logging.getLogger("benchmarks.flux2_klein")

#: black-forest-labs/FLUX.2-klein-4B transformer/config.json
KLEIN_4B = dict(patch_size=1, in_channels=128, num_layers=5, num_single_layers=20, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=7680, timestep_guidance_channels=256, mlp_ratio=3.0,
                axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, eps=1e-6, guidance_embeds=False)
#: Qwen/Qwen3-4B config.json (the encoder FLUX.2 [klein] 4B ships in text_encoder/)
QWEN3_4B = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, use_cache=False)


def build_klein_4b(out: Path, seed: int = 0) -> dict[str, int]:
    """Write the pipeline folder; returns parameters per component."""
    from diffusers import AutoencoderKLFlux2
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tasks.common.families.flow import flow_scheduler
    from tasks.common.families.flux2 import _with_latent_statistics
    from tasks.common.families.tiny import qwen_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = qwen_tokenizer(max_length=512)
    index: dict[str, Any] = {"_class_name": "Flux2KleinPipeline", "_diffusers_version": "0.40.0", "is_distilled": True}
    params = {"transformer": save_transformer(out, seed, KLEIN_4B, "Flux2Transformer2DModel")}
    index["transformer"] = ["diffusers", "Flux2Transformer2DModel"]
    parts = {"vae": lambda: _with_latent_statistics(AutoencoderKLFlux2()),  # the class's defaults are FLUX.2's
             "text_encoder": lambda: Qwen3ForCausalLM(Qwen3Config(**QWEN3_4B, pad_token_id=tokenizer.pad_token_id))}
    for i, (name, build) in enumerate(parts.items(), 1):
        library, cls, params[name] = _save(name, build, out, seed + i)
        index[name] = [library, cls]
    return finish(out, index, {"tokenizer": tokenizer}, flow_scheduler(shift=3.0, dynamic=True), params,
                  unused=())  # klein has no IP-Adapter parts


def main() -> None:
    build_command(__doc__, ".cache/bench/flux2-klein-4b", build_klein_4b)


if __name__ == "__main__":
    main()
