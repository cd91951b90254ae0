"""LTX-Video 2B (0.9.x) with seeded random weights, saved as a diffusers LTXPipeline folder.

The architecture is Lightricks/LTX-Video's diffusers layout (0.9.0-0.9.5 share it), from the
published configs, which are the diffusers classes' defaults:
- the 1.9B-parameter LTXVideoTransformer3DModel: 28 layers 2048 wide (32 heads of 64), RMS QK-norm
  across heads, cross-attention over 4096-wide T5 features projected to 2048, 1x1x1 patches on
  128-channel latents;
- the causal video VAE AutoencoderKLLTXVideo (4x4 pixel patches then three space-time halvings: 32x
  in space, 8x in time, 128 latent channels), with its class defaults (0.9.0's VAE; 0.9.1 and later
  add timestep conditioning and noise injection to the decoder, which training's encoder never runs);
- T5-v1.1-XXL's encoder (T5EncoderModel: 24 layers, d_model 4096, d_ff 10240 gated-GELU, 64 heads of
  64, 32,128 tokens), the config benchmarks/sd35/build.py already holds;
- FlowMatchEulerDiscreteScheduler with the release's dynamic shift (as tasks/common/families/ltx.py).

Nothing is downloaded. The tokenizer is the project's locally made T5 Unigram tokenizer (as the
SD3.5 benchmark's); its ids are a subset of the embedding's 32,128 rows, so the encoder's size is
the real one.

Every component is built as a module in bf16 (the release's dtype), one at a time (T5-XXL, the
largest, is 9.5 GB resident while it is saved; 10.6 GB peak RSS, 8 min 46 s here under load 5-9).

    .venv/bin/python -m benchmarks.ltx.build --out .cache/bench/ltx-2b     # 14.2 GB (13.2 GiB) on disk
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from benchmarks.sd35.build import T5_XXL, _save, build_command, finish

log = logging.getLogger("benchmarks.ltx")

#: Lightricks/LTX-Video transformer/config.json (LTXVideoTransformer3DModel's defaults)
LTX_2B = dict(in_channels=128, out_channels=128, patch_size=1, patch_size_t=1, num_attention_heads=32,
              attention_head_dim=64, cross_attention_dim=2048, num_layers=28, activation_fn="gelu-approximate",
              qk_norm="rms_norm_across_heads", norm_elementwise_affine=False, norm_eps=1e-6, caption_channels=4096,
              attention_bias=True, attention_out_bias=True)
#: Lightricks/LTX-Video vae/config.json as of 0.9.0 (AutoencoderKLLTXVideo's defaults)
VAE = dict(in_channels=3, out_channels=3, latent_channels=128, block_out_channels=(128, 256, 512, 512),
           layers_per_block=(4, 3, 3, 3, 4), spatio_temporal_scaling=(True, True, True, False),
           patch_size=4, patch_size_t=1, encoder_causal=True, decoder_causal=False, scaling_factor=1.0)
#: Lightricks/LTX-Video scheduler/scheduler_config.json: dynamic shift over the video's token count
SCHEDULER = dict(shift=1.0, use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05, base_image_seq_len=1024,
                 max_image_seq_len=4096, shift_terminal=0.1)


def build_ltx(out: Path, seed: int = 0) -> dict[str, int]:
    """Write the pipeline folder; returns parameters per component."""
    from diffusers import AutoencoderKLLTXVideo, FlowMatchEulerDiscreteScheduler, LTXVideoTransformer3DModel
    from transformers import T5Config, T5EncoderModel

    from tasks.common.families.ltx import LTXVideo
    from tasks.common.families.tiny import t5_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = t5_tokenizer(max_length=LTXVideo.text.max_sequence_length)
    index: dict[str, Any] = {"_class_name": "LTXPipeline", "_diffusers_version": "0.40.0"}
    parts = {"transformer": lambda: LTXVideoTransformer3DModel(**LTX_2B),
             "vae": lambda: AutoencoderKLLTXVideo(**VAE),
             "text_encoder": lambda: T5EncoderModel(T5Config(**T5_XXL))}
    params = {}
    for i, (name, build) in enumerate(parts.items()):
        library, cls, params[name] = _save(name, build, out, seed + i)
        index[name] = [library, cls]
    return finish(out, index, {"tokenizer": tokenizer}, FlowMatchEulerDiscreteScheduler(**SCHEDULER), params,
                  unused=())  # LTXPipeline has no optional parts


def main() -> None:
    build_command(__doc__, ".cache/bench/ltx-2b", build_ltx)


if __name__ == "__main__":
    main()
