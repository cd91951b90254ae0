"""The built-in offline models `builtin:tiny-sd` and `builtin:tiny-sdxl`.

Real diffusers/transformers classes (UNet2DConditionModel, AutoencoderKL, CLIP text encoders, a
CLIP BPE tokenizer) at toy sizes, with weights drawn from a seed: the same seed gives the same
bytes. Images they make are noise; everything around them (training, export, evaluation) is real.
Sizes follow diffusers' own pipeline tests: 64 px images, 32x32 latents.
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

BUILTIN_PIPELINES = ("builtin:tiny-sd", "builtin:tiny-sdxl")

# Words the tokenizer's merges are learned from: the demo's and the DreamBooth paper's prompt
# vocabulary, so that common prompt words become single tokens as in a real CLIP vocabulary.
_CORPUS = """
a an the photo picture of in on with and at by sks toy dog cat robot figure backpack
vase teapot bowl clock sneaker glasses candle boot sunglasses berry plushie monster cartoon
jungle snow beach city street water grass table floor background wooden purple red blue green
yellow shiny wet cube sitting top mirror bed house pink fur wearing santa hat rainbow scarf chef
outfit police firefighter sailor angel wings witch purple high quality yellow dicoo close up view
"""
_NUM_MERGES = 300


def _byte_unicode() -> dict[int, str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return bytes_to_unicode()


def _learn_merges(words: list[str], num_merges: int) -> list[tuple[str, str]]:
    """Plain BPE over the corpus words, CLIP-style (last symbol of a word carries '</w>')."""
    vocab = Counter(tuple(w[:-1]) + (w[-1] + "</w>",) for w in words)
    merges: list[tuple[str, str]] = []
    for _ in range(num_merges):
        pairs: Counter[tuple[str, str]] = Counter()
        for word, freq in vocab.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += freq
        if not pairs:
            break
        # Most frequent pair; ties broken lexicographically so the result is deterministic.
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        merged: Counter[tuple[str, ...]] = Counter()
        for word, freq in vocab.items():
            out, i = [], 0
            while i < len(word):
                if i < len(word) - 1 and (word[i], word[i + 1]) == best:
                    out.append(word[i] + word[i + 1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += freq
        vocab = merged
    return merges


def write_tokenizer(out: Path) -> int:
    """Write a CLIP BPE tokenizer (vocab.json, merges.txt) generated locally; returns vocab size."""
    from transformers import CLIPTokenizer

    out.mkdir(parents=True, exist_ok=True)
    symbols = list(_byte_unicode().values())
    tokens = symbols + [s + "</w>" for s in symbols]
    merges = _learn_merges(_CORPUS.split(), _NUM_MERGES)
    tokens += ["".join(pair) for pair in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    vocab = {tok: i for i, tok in enumerate(dict.fromkeys(tokens))}
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (out / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    tok = CLIPTokenizer(
        str(out / "vocab.json"), str(out / "merges.txt"), model_max_length=77, pad_token="<|endoftext|>"
    )
    tok.save_pretrained(out)
    return len(vocab)


def _text_config(vocab_size: int, projection_dim: int | None = None, hidden_size: int = 32):
    from transformers import CLIPTextConfig

    extra = {"projection_dim": projection_dim} if projection_dim else {}
    return CLIPTextConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=37,
        num_attention_heads=4,
        num_hidden_layers=2,
        max_position_embeddings=77,
        hidden_act="gelu",
        bos_token_id=vocab_size - 2,
        eos_token_id=vocab_size - 1,
        pad_token_id=vocab_size - 1,
        **extra,
    )


def _vae(sample_size: int):
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        block_out_channels=(32, 64),
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        latent_channels=4,
        sample_size=sample_size,
    )


def _scheduler_kwargs() -> dict:
    return dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", steps_offset=1)


def build_tiny_sd(seed: int):
    """A tiny SD 1.x pipeline: one CLIP text encoder, 32-channel cross-attention."""
    import tempfile

    import torch
    from diffusers import DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        vocab_size = write_tokenizer(Path(tmp))
        tokenizer = CLIPTokenizer.from_pretrained(tmp)
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        block_out_channels=(32, 64),
        layers_per_block=2,
        sample_size=32,
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=8,
    )
    torch.manual_seed(seed + 1)
    vae = _vae(64)
    torch.manual_seed(seed + 2)
    text_encoder = CLIPTextModel(_text_config(vocab_size))
    scheduler = DDIMScheduler(**_scheduler_kwargs(), clip_sample=False, set_alpha_to_one=False)
    return StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def build_tiny_sdxl(seed: int, text_2_width: int = 32):
    """A tiny SDXL pipeline: two text encoders (the second with projection), size/crop conditioning.

    `text_2_width`: the second encoder's width (SDXL's are 768 and 1280; here both 32 unless set).
    """
    import tempfile

    import torch
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        vocab_size = write_tokenizer(Path(tmp))
        tokenizer = CLIPTokenizer.from_pretrained(tmp)
        tokenizer_2 = CLIPTokenizer.from_pretrained(tmp)
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        block_out_channels=(32, 64),
        layers_per_block=2,
        sample_size=32,
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 4),
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=8,
        transformer_layers_per_block=(1, 2),
        projection_class_embeddings_input_dim=6 * 8 + 32,  # 6 size/crop ids x 8 + pooled text (32)
        cross_attention_dim=32 + text_2_width,  # both encoders' hidden states, concatenated
        norm_num_groups=1,
    )
    torch.manual_seed(seed + 1)
    vae = _vae(128)
    torch.manual_seed(seed + 2)
    text_encoder = CLIPTextModel(_text_config(vocab_size))
    torch.manual_seed(seed + 3)
    text_encoder_2 = CLIPTextModelWithProjection(
        _text_config(vocab_size, projection_dim=32, hidden_size=text_2_width)
    )
    scheduler = EulerDiscreteScheduler(**_scheduler_kwargs(), timestep_spacing="leading")
    return StableDiffusionXLPipeline(
        vae=vae,
        text_encoder=text_encoder,
        text_encoder_2=text_encoder_2,
        tokenizer=tokenizer,
        tokenizer_2=tokenizer_2,
        unet=unet,
        scheduler=scheduler,
        force_zeros_for_empty_prompt=True,
    )


def build_tiny_pipeline(kind: str, seed: int, out: Path) -> Path:
    """Build `builtin:tiny-sd` or `builtin:tiny-sdxl` from `seed` and save it to `out` (safetensors)."""
    builders = {"builtin:tiny-sd": build_tiny_sd, "builtin:tiny-sdxl": build_tiny_sdxl}
    if kind not in builders:
        raise ValueError(f"unknown built-in model {kind!r}; choose one of {', '.join(builders)}")
    pipe = builders[kind](seed)
    out = Path(out)
    pipe.save_pretrained(out, safe_serialization=True)
    return out
