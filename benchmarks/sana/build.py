"""Sana 1600M (1024px) with seeded random weights, saved as a diffusers folder.

The architecture is Efficient-Large-Model/Sana_1600M_1024px_BF16_diffusers', from its published configs:
- the 1.6B-parameter SanaTransformer2DModel: 20 linear-attention layers 2240 wide (70 heads of 32),
  cross-attention over 2304-wide Gemma-2 features (20 heads of 112), Mix-FFN (mlp ratio 2.5), 1x1
  patches on 32-channel latents, sample size 32 (1024 px / 32);
- the deep-compression autoencoder DC-AE f32c32 (AutoencoderDC, 32x down, 32 latent channels,
  EfficientViT blocks in its last 3 stages), scaling factor 0.41407;
- Gemma-2 2B (google/gemma-2-2b-it's config; the release ships the decoder, Gemma2Model) as the text
  encoder: 26 layers, 2304 wide, 8 query and 4 key/value heads of 256, 256,000 tokens;
- DPM-Solver++ with flow sigmas and flow prediction, flow shift 3 (the 1024px models').

Nothing is downloaded. The tokenizer is the project's locally learned Gemma-style BPE (its ids are a
subset of the embedding's 256,000 rows, so the encoder's size is the real one).

Every component is built as a module in bf16 (the release's dtype), one at a time (Gemma-2 2B, the
largest, is 5.2 GB resident while it is saved).

    .venv/bin/python -m benchmarks.sana.build --out .cache/bench/sana-1600m    # 9 GB (8.4 GiB) on disk
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from benchmarks.sd35.build import _save, build_command, finish

log = logging.getLogger("benchmarks.sana")

#: Efficient-Large-Model/Sana_1600M_1024px_BF16_diffusers transformer/config.json (SanaMS_1600M_P1_D20 in
#: diffusers' scripts/convert_sana_to_diffusers.py; also SanaTransformer2DModel's defaults)
SANA_1600M = dict(in_channels=32, out_channels=32, num_attention_heads=70, attention_head_dim=32, num_layers=20,
                  num_cross_attention_heads=20, cross_attention_head_dim=112, cross_attention_dim=2240,
                  caption_channels=2304, mlp_ratio=2.5, dropout=0.0, attention_bias=False, sample_size=32,
                  patch_size=1, norm_elementwise_affine=False, norm_eps=1e-6, interpolation_scale=None,
                  guidance_embeds=False, qk_norm=None)  # no QK norm: Sana 1.0 (1.5 and Sprint have it)
#: Efficient-Large-Model/Sana_1600M_1024px_BF16_diffusers vae/config.json (mit-han-lab/dc-ae-f32c32-sana-1.0,
#: as diffusers' scripts/convert_dcae_to_diffusers.py builds it). Not AutoencoderDC's defaults: those have
#: ResBlocks in every stage and pixel (un)shuffle resampling; the sana variant has EfficientViT blocks in
#: the last 3 stages, strided-conv downsampling and interpolating upsampling.
DC_AE_F32C32 = dict(in_channels=3, latent_channels=32, attention_head_dim=32,
                    encoder_block_types=("ResBlock",) * 3 + ("EfficientViTBlock",) * 3,
                    decoder_block_types=("ResBlock",) * 3 + ("EfficientViTBlock",) * 3,
                    encoder_block_out_channels=(128, 256, 512, 512, 1024, 1024),
                    decoder_block_out_channels=(128, 256, 512, 512, 1024, 1024),
                    encoder_layers_per_block=(2, 2, 2, 3, 3, 3), decoder_layers_per_block=(3, 3, 3, 3, 3, 3),
                    encoder_qkv_multiscales=((), (), (), (5,), (5,), (5,)),
                    decoder_qkv_multiscales=((), (), (), (5,), (5,), (5,)),
                    downsample_block_type="conv", upsample_block_type="interpolate",
                    decoder_norm_types="rms_norm", decoder_act_fns="silu", scaling_factor=0.41407)
#: google/gemma-2-2b-it config.json (Sana's text_encoder/ is its decoder). Unsure: the release's
#: eos_token_id (1 here; the -it generation config adds 107, no matter to an encoder) and use_cache (the
#: published config's is true; False here as the project's other encoders, the weights are the same).
GEMMA2_2B = dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
                 hidden_activation="gelu_pytorch_tanh", max_position_embeddings=8192, rms_norm_eps=1e-6,
                 rope_theta=10000.0, sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                 attention_bias=False, tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=2,
                 use_cache=False)
#: Efficient-Large-Model/Sana_1600M_1024px_BF16_diffusers scheduler/scheduler_config.json (the rest the
#: class's defaults: DPM-Solver++ order 2); 1024px models shift 3 (4K: 6)
SCHEDULER = dict(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)


def build_sana(out: Path, seed: int = 0) -> dict[str, int]:
    """Write the pipeline folder; returns parameters per component."""
    from diffusers import AutoencoderDC, DPMSolverMultistepScheduler, SanaTransformer2DModel
    from transformers import Gemma2Config, Gemma2Model

    from tasks.common.families.sana import Sana
    from tasks.common.families.tiny import gemma_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = gemma_tokenizer(max_length=Sana.text.max_sequence_length)
    index: dict[str, Any] = {"_class_name": "SanaPipeline", "_diffusers_version": "0.40.0"}
    parts = {"transformer": lambda: SanaTransformer2DModel(**SANA_1600M),
             "vae": lambda: AutoencoderDC(**DC_AE_F32C32),
             "text_encoder": lambda: Gemma2Model(Gemma2Config(**GEMMA2_2B))}
    params = {}
    for i, (name, build) in enumerate(parts.items()):
        library, cls, params[name] = _save(name, build, out, seed + i)
        index[name] = [library, cls]
    return finish(out, index, {"tokenizer": tokenizer}, DPMSolverMultistepScheduler(**SCHEDULER), params,
                  unused=())  # SanaPipeline has no optional parts


def main() -> None:
    build_command(__doc__, ".cache/bench/sana-1600m", build_sana)


if __name__ == "__main__":
    main()
