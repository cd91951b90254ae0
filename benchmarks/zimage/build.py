"""Z-Image (6B) with seeded random weights, saved as a diffusers folder.

The architecture is Tongyi-MAI/Z-Image-Turbo's, from its published configs:
- the 6.15B-parameter ZImageTransformer2DModel: 30 layers and 2 noise/context refiner layers,
  3840 wide, 30 heads, 2560-wide caption features, 2x2 patches;
- FLUX.1's 16-channel AutoencoderKL, with its scaling and shift;
- Qwen3-4B as the text encoder (Qwen3Model, the same config as FLUX.2 [klein] 4B's);
- the flow-matching scheduler with shift 3.

Nothing is downloaded. The tokenizer is the project's locally learned Qwen byte-level BPE.

The transformer is written tensor by tensor in 2 GB shards (benchmarks/flux_dev/build.py); Qwen3-4B
is built as a module in bf16.

    .venv/bin/python -m benchmarks.zimage.build --out .cache/bench/z-image-6b    # 20 GB (GiB) on disk
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from benchmarks.flux2_klein.build import QWEN3_4B
from benchmarks.flux_dev.build import FLUX_VAE, save_transformer
from benchmarks.sd35.build import _save, build_command, finish

log = logging.getLogger("benchmarks.zimage")

#: Tongyi-MAI/Z-Image-Turbo transformer/config.json
Z_IMAGE = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=3840, n_layers=30, n_refiner_layers=2,
               n_heads=30, n_kv_heads=30, norm_eps=1e-5, qk_norm=True, cap_feat_dim=2560, rope_theta=256.0,
               t_scale=1000.0, axes_dims=[32, 48, 48], axes_lens=[1024, 512, 512])


def build_z_image(out: Path, seed: int = 0) -> dict[str, int]:
    """Write the pipeline folder; returns parameters per component."""
    from diffusers import AutoencoderKL
    from transformers import Qwen3Config, Qwen3Model

    from tasks.common.families.flow import flow_scheduler
    from tasks.common.families.tiny import qwen_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = qwen_tokenizer(max_length=512)
    index: dict[str, Any] = {"_class_name": "ZImagePipeline", "_diffusers_version": "0.40.0"}
    params = {"transformer": save_transformer(out, seed, Z_IMAGE, "ZImageTransformer2DModel")}
    index["transformer"] = ["diffusers", "ZImageTransformer2DModel"]
    parts = {"vae": lambda: AutoencoderKL(**FLUX_VAE),
             "text_encoder": lambda: Qwen3Model(Qwen3Config(**QWEN3_4B, pad_token_id=tokenizer.pad_token_id))}
    for i, (name, build) in enumerate(parts.items(), 1):
        library, cls, params[name] = _save(name, build, out, seed + i)
        index[name] = [library, cls]
    return finish(out, index, {"tokenizer": tokenizer}, flow_scheduler(shift=3.0), params, unused=())


def main() -> None:
    build_command(__doc__, ".cache/bench/z-image-6b", build_z_image)


if __name__ == "__main__":
    main()
