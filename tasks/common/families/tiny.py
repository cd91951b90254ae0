"""Pieces the families' built-in tiny models share: locally learned CLIP, T5 and Qwen tokenizers, toy
text encoder configs (CLIP, T5, Qwen3), a toy VAE, seeding.

The tiny models are real diffusers/transformers classes at toy sizes, with weights drawn from a
seed: the same seed gives the same bytes. Images they make are noise; everything around them
(training, export, evaluation) is real. Sizes follow diffusers' own pipeline tests.
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

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


def _learn_merges(words: list[str], num_merges: int, end: str = "</w>") -> list[tuple[str, str]]:
    """Plain BPE over the corpus words; the last symbol of a word carries `end` (CLIP: '</w>',
    byte-level BPE as GPT-2/Qwen: nothing, the word's leading space is its own 'Ġ' symbol)."""
    vocab = Counter(tuple(w[:-1]) + (w[-1] + end,) for w in words)
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


def clip_tokenizer():
    """(CLIPTokenizer, vocabulary size) of the locally learned vocabulary."""
    import tempfile

    from transformers import CLIPTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        vocab_size = write_tokenizer(Path(tmp))
        return CLIPTokenizer.from_pretrained(tmp), vocab_size


def clip_text_config(vocab_size: int, projection_dim: int | None = None, hidden_size: int = 32):
    """A 2-layer CLIP text encoder config over the tiny vocabulary."""
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


def tiny_vae(sample_size: int, latent_channels: int = 4, **config):
    """A 2-block AutoencoderKL (latents at half the image size)."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        block_out_channels=(32, 64),
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        latent_channels=latent_channels,
        sample_size=sample_size,
        **config,
    )


def ddpm_kwargs() -> dict:
    """The SD 1.x/SDXL training schedule's betas."""
    return dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", steps_offset=1)


def seeded(seed: int, build):
    """`build()` right after seeding torch's global RNG with `seed` (its weights follow from the seed)."""
    import torch

    torch.manual_seed(seed)
    return build()


def t5_tokenizer(max_length: int = 32):
    """A SentencePiece-style Unigram tokenizer over the same corpus, built locally with the
    `tokenizers` library, as T5TokenizerFast: `<pad>` 0, `</s>` 1, `<unk>` 2, as T5's own
    vocabulary numbers them; saved with save_pretrained it is the standard tokenizer.json that
    `T5TokenizerFast.from_pretrained` reads. `max_length` is its model_max_length.

    The pieces are the corpus's words (with SentencePiece's leading "▁") and its characters, each
    scored by its log frequency (characters far below words, so a known word stays one piece). Counted
    here rather than by tokenizers' UnigramTrainer, whose scores vary in their last digits between runs.
    """
    import math

    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import T5TokenizerFast

    words = Counter(_CORPUS.split())
    chars = Counter(c for word, n in words.items() for c in word * n)
    total = sum(words.values()) + sum(chars.values())
    pieces = [("▁" + w, math.log(n / total)) for w, n in sorted(words.items())]
    pieces += [("▁", math.log(len(words) / total) - 10)]
    pieces += [(c, math.log(n / total) - 10) for c, n in sorted(chars.items())]
    tok = Tokenizer(models.Unigram([("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), *pieces], unk_id=2))
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>",
                                                       special_tokens=[("</s>", 1)])
    return T5TokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
                           extra_ids=0, model_max_length=max_length)


def t5_config(vocab_size: int, d_model: int = 32):
    """A 2-layer T5 encoder config over the tiny vocabulary."""
    from transformers import T5Config

    return T5Config(vocab_size=vocab_size, d_model=d_model, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
                    relative_attention_num_buckets=8, dropout_rate=0.0, feed_forward_proj="gated-gelu",
                    is_encoder_decoder=False, use_cache=False, pad_token_id=0, eos_token_id=1,
                    decoder_start_token_id=0)


# Qwen3's chat template, cut to what a text-to-image pipeline renders: user turns, then the assistant's
# opening (with the empty thinking block when enable_thinking is false, as Qwen3's own template writes it).
_QWEN_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


def qwen_tokenizer(max_length: int = 512, extra_words: tuple[str, ...] = ()):
    """A byte-level BPE tokenizer over the corpus, as Qwen2/Qwen3's: the 256 byte symbols, merges
    learned from the corpus words with their leading space ('Ġ'), then `<|endoftext|>` (padding),
    `<|im_start|>`, `<|im_end|>` (end of a turn) and `<think>`, `</think>`, with a Qwen3-style chat
    template. Saved and read back with `Qwen2TokenizerFast.from_pretrained`, as a pipeline loads it.
    `extra_words` (as the pre-tokenizer cuts them: 'Ġ' for a leading space) are learned as well, with
    merges enough to make each one token (Qwen-Image's system prompt, which its pipeline counts)."""
    import tempfile

    from tokenizers import AddedToken
    from transformers import Qwen2TokenizerFast

    words = ["Ġ" + w for w in _CORPUS.split()] + ["user", "assistant"]  # the template's roles, after a newline
    merges = _learn_merges(words + list(extra_words), _NUM_MERGES + sum(len(w) - 1 for w in extra_words), end="")
    tokens = list(_byte_unicode().values()) + ["".join(pair) for pair in merges]
    vocab = {tok: i for i, tok in enumerate(dict.fromkeys(tokens))}
    tok = Qwen2TokenizerFast(vocab=vocab, merges=merges, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                             unk_token=None, additional_special_tokens=["<|im_start|>", "<|im_end|>"],
                             chat_template=_QWEN_CHAT_TEMPLATE, model_max_length=max_length)
    tok.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    with tempfile.TemporaryDirectory() as tmp:
        tok.save_pretrained(tmp)
        return Qwen2TokenizerFast.from_pretrained(tmp)


def qwen3_config(vocab_size: int, pad_token_id: int, num_hidden_layers: int = 2, hidden_size: int = 16):
    """A Qwen3 decoder config at toy width (2 query heads of 8, one key/value head)."""
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                       num_hidden_layers=num_hidden_layers, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                       max_position_embeddings=1024, tie_word_embeddings=True, pad_token_id=pad_token_id,
                       use_cache=False)


def gemma_tokenizer(max_length: int = 300):
    """A SentencePiece-style BPE tokenizer with byte fallback over the corpus, as Gemma's: `<pad>` 0,
    `<eos>` 1, `<bos>` 2, `<unk>` 3, `<mask>` 4, the 256 byte pieces `<0x00>`..`<0xFF>` (what no piece
    covers, capitals and punctuation here, falls back to bytes), then the corpus's characters with
    SentencePiece's "▁" and merges learned from its words; a `<bos>` starts every sequence, no `<eos>`
    ends it. Saved and read back with `GemmaTokenizer.from_pretrained`, as a pipeline loads it."""
    import tempfile

    from transformers import GemmaTokenizer

    words = ["▁" + w for w in _CORPUS.split()]
    merges = _learn_merges(words, _NUM_MERGES, end="")
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", *(f"<0x{b:02X}>" for b in range(256)),
              *sorted({c for w in words for c in w}), *("".join(pair) for pair in merges)]
    vocab = {tok: i for i, tok in enumerate(dict.fromkeys(tokens))}
    tok = GemmaTokenizer(vocab=vocab, merges=merges, model_max_length=max_length, add_bos_token=True,
                         add_eos_token=False)
    with tempfile.TemporaryDirectory() as tmp:
        tok.save_pretrained(tmp)
        return GemmaTokenizer.from_pretrained(tmp)


def gemma2_config(vocab_size: int, hidden_size: int = 16):
    """A 2-layer Gemma2 decoder config at toy width (2 query heads of 8, one key/value head), Gemma's
    special token ids."""
    from transformers import Gemma2Config

    return Gemma2Config(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                        query_pre_attn_scalar=8, max_position_embeddings=2048, sliding_window=512,
                        pad_token_id=0, eos_token_id=1, bos_token_id=2, use_cache=False)
