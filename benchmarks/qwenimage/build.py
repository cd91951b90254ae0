"""Qwen-Image (20B) with seeded random weights, saved as a diffusers folder.

The architecture is Qwen/Qwen-Image's, from its published configs:
- the QwenImageTransformer2DModel: 60 double-stream layers, 24 heads of 128, 3584-wide text
  features, 2x2 patches (the class's defaults are the release's config);
- the 16-channel AutoencoderKLQwenImage (the class's defaults: Wan 2.1's VAE layout and its latent
  statistics);
- Qwen2.5-VL-7B-Instruct as the text encoder (Qwen2_5_VLForConditionalGeneration, its vision tower
  included, as the release ships it);
- the release's flow-matching scheduler (dynamic exponential shift), as the tiny model's.

Nothing is downloaded. The tokenizer is the project's locally learned Qwen byte-level BPE with the
pipeline's system words (tasks/common/families/qwenimage.py).

The transformer is written tensor by tensor in 2 GB shards (benchmarks/flux_dev/build.py), 41 GB
(GiB 38) in bf16. Qwen2.5-VL-7B is built as a module in bf16, 16.6 GB resident while it is saved.

    .venv/bin/python -m benchmarks.qwenimage.build --out .cache/bench/qwen-image    # 55 GB (GiB) on disk
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from benchmarks.flux_dev.build import save_transformer
from benchmarks.sd35.build import _save, build_command, finish

log = logging.getLogger("benchmarks.qwenimage")

#: Qwen/Qwen-Image transformer/config.json
QWEN_IMAGE = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                  num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=(16, 56, 56))
#: Qwen/Qwen2.5-VL-7B-Instruct config.json (text and vision parts)
QWEN25_VL_7B_TEXT = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                         num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=128000,
                         rms_norm_eps=1e-6, tie_word_embeddings=False, use_cache=False,
                         rope_parameters={"rope_type": "default", "mrope_section": [16, 24, 24],
                                          "rope_theta": 1000000.0})
QWEN25_VL_7B_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu")


def build_qwen_image(out: Path, seed: int = 0) -> dict[str, int]:
    """Write the pipeline folder; returns parameters per component."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from tasks.common.families.qwenimage import _SYSTEM_WORDS
    from tasks.common.families.tiny import qwen_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = qwen_tokenizer(max_length=1058, extra_words=_SYSTEM_WORDS)
    index: dict[str, Any] = {"_class_name": "QwenImagePipeline", "_diffusers_version": "0.40.0"}
    params = {"transformer": save_transformer(out, seed, QWEN_IMAGE, "QwenImageTransformer2DModel")}
    index["transformer"] = ["diffusers", "QwenImageTransformer2DModel"]
    text = {**QWEN25_VL_7B_TEXT, "pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}
    config = Qwen2_5_VLConfig(text_config=text, vision_config=QWEN25_VL_7B_VISION)
    parts = {"vae": AutoencoderKLQwenImage, "text_encoder": lambda: Qwen2_5_VLForConditionalGeneration(config)}
    for i, (name, build) in enumerate(parts.items(), 1):
        library, cls, params[name] = _save(name, build, out, seed + i)
        index[name] = [library, cls]
    scheduler = FlowMatchEulerDiscreteScheduler(  # Qwen/Qwen-Image scheduler/scheduler_config.json
        shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9, base_image_seq_len=256,
        max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential")
    return finish(out, index, {"tokenizer": tokenizer}, scheduler, params, unused=())


def main() -> None:
    build_command(__doc__, ".cache/bench/qwen-image", build_qwen_image)


if __name__ == "__main__":
    main()
