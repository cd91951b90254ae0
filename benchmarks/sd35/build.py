"""Stable Diffusion 3.5 Medium's architecture with seeded random weights, saved as a diffusers folder.

Every config value is the published one of stabilityai/stable-diffusion-3.5-medium (MMDiT-X
transformer: 24 layers, 1536 wide, dual attention in layers 0-12, RMS QK-norm; 16-channel VAE;
CLIP ViT-L/14 and OpenCLIP ViT-bigG/14 text encoders with projections; T5-v1.1-XXL encoder;
FlowMatchEulerDiscreteScheduler with shift 3). Nothing is downloaded: the weights are drawn from
a seed in bf16 (the published checkpoint's dtype), one component at a time, so the build never
holds more than the largest part (T5-XXL, 9.5 GB). The tokenizers are the project's locally made
CLIP BPE and T5 Unigram tokenizers (their ids stay inside the real embedding tables).

    .venv/bin/python -m benchmarks.sd35.build --out .cache/bench/sd35-medium     # 16 GB on disk
    .venv/bin/python -m benchmarks.sd35.build --out .cache/bench/sd35-8-6 --transformer-layers 8 --t5-layers 6
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger("benchmarks.sd35")

TRANSFORMER = dict(  # transformer/config.json
    sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24, attention_head_dim=64,
    num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536, pooled_projection_dim=2048,
    pos_embed_max_size=384, dual_attention_layers=tuple(range(13)), qk_norm="rms_norm",
)
VAE = dict(  # vae/config.json
    in_channels=3, out_channels=3, latent_channels=16, layers_per_block=2, sample_size=1024,
    block_out_channels=(128, 256, 512, 512), down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4, scaling_factor=1.5305, shift_factor=0.0609,
    use_quant_conv=False, use_post_quant_conv=False,
)
CLIP_L = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
              num_attention_heads=12, max_position_embeddings=77, hidden_act="quick_gelu", projection_dim=768)
CLIP_G = dict(vocab_size=49408, hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
              num_attention_heads=20, max_position_embeddings=77, hidden_act="gelu", projection_dim=1280)
T5_XXL = dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
              relative_attention_num_buckets=32, feed_forward_proj="gated-gelu", is_encoder_decoder=False,
              dense_act_fn="gelu_new", is_gated_act=True, tie_word_embeddings=False)
SCHEDULER_SHIFT = 3.0


@contextlib.contextmanager
def _default_dtype(dtype: Any) -> Iterator[None]:
    import torch

    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _save(name: str, build: Callable[[], Any], out: Path, seed: int) -> tuple[str, str, int]:
    """Build one component in bf16 from `seed`, save it under out/name, free it; (library, class, params)."""
    import torch

    torch.manual_seed(seed)
    start = time.perf_counter()
    with _default_dtype(torch.bfloat16):
        module = build()
    module.save_pretrained(out / name)
    params = sum(p.numel() for p in module.parameters())
    library = "diffusers" if type(module).__module__.startswith("diffusers") else "transformers"
    result = (library, type(module).__name__, params)
    del module
    gc.collect()
    log.info("%s: %s, %.2fB parameters, %.0f s", name, result[1], params / 1e9, time.perf_counter() - start)
    return result


def build_sd35_medium(out: Path, seed: int = 0, transformer_layers: int | None = None,
                      t5_layers: int | None = None) -> dict[str, int]:
    """Write the pipeline folder; returns parameters per component. `transformer_layers` and
    `t5_layers` cut the depth (same widths; the dual-attention layers stay the first 13/24 of them):
    a smaller model with the same kinds of parts, for memory comparisons on a small machine."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    from tasks.common.families.tiny import clip_tokenizer, t5_tokenizer

    transformer, t5 = dict(TRANSFORMER), dict(T5_XXL)
    if transformer_layers is not None:
        transformer.update(num_layers=transformer_layers,
                           dual_attention_layers=tuple(range(transformer_layers * 13 // 24)))
    if t5_layers is not None:
        t5.update(num_layers=t5_layers)
    out.mkdir(parents=True, exist_ok=True)
    parts = {
        "transformer": lambda: SD3Transformer2DModel(**transformer),
        "vae": lambda: AutoencoderKL(**VAE),
        "text_encoder": lambda: CLIPTextModelWithProjection(CLIPTextConfig(**CLIP_L)),
        "text_encoder_2": lambda: CLIPTextModelWithProjection(CLIPTextConfig(**CLIP_G)),
        "text_encoder_3": lambda: T5EncoderModel(T5Config(**t5)),
    }
    index: dict[str, Any] = {"_class_name": "StableDiffusion3Pipeline", "_diffusers_version": "0.39.0"}
    params = {}
    for i, (name, build) in enumerate(parts.items()):
        library, cls, params[name] = _save(name, build, out, seed + i)
        index[name] = [library, cls]
    tokenizers = {"tokenizer": clip_tokenizer()[0], "tokenizer_2": clip_tokenizer()[0],
                  "tokenizer_3": t5_tokenizer(max_length=256)}
    return finish(out, index, tokenizers, FlowMatchEulerDiscreteScheduler(shift=SCHEDULER_SHIFT), params)


def finish(out: Path, index: dict[str, Any], tokenizers: dict[str, Any], scheduler: Any,
           params: dict[str, int], unused: tuple[str, ...] = ("image_encoder", "feature_extractor")) -> dict[str, int]:
    """Write the tokenizers, the scheduler, model_index.json and parameters.json; returns `params`.
    `unused`: the pipeline's optional parts, recorded as absent (SD3's and FLUX.1's IP-Adapter parts)."""
    for name, tokenizer in tokenizers.items():
        tokenizer.save_pretrained(out / name)
        index[name] = ["transformers", type(tokenizer).__name__]
    scheduler.save_pretrained(out / "scheduler")
    index["scheduler"] = ["diffusers", type(scheduler).__name__]
    index.update(dict.fromkeys(unused, [None, None]))
    (out / "model_index.json").write_text(json.dumps(index, indent=2))
    (out / "parameters.json").write_text(json.dumps(params, indent=2))
    return params


def build_command(description: str, default_out: str, build: Any) -> None:
    """The command line of a real-size build script (`--out`, `--seed`): `build(out, seed)`'s parameter
    counts printed, or nothing done where the folder is built already (its parameters.json)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(default_out))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if (args.out / "parameters.json").is_file():
        log.info("%s is built already", args.out)
        return
    print(json.dumps(build(args.out, args.seed), indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(".cache/bench/sd35-medium"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--transformer-layers", type=int, help="fewer transformer layers than the published 24")
    parser.add_argument("--t5-layers", type=int, help="fewer T5 encoder layers than the published 24")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if (args.out / "parameters.json").is_file():
        log.info("%s is built already", args.out)
        return
    print(json.dumps(build_sd35_medium(args.out, args.seed, args.transformer_layers, args.t5_layers), indent=2))


if __name__ == "__main__":
    main()
