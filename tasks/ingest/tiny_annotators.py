"""Built-in tiny annotation models: the real transformers classes at toy sizes, seeded weights.

`builtin:tiny-blip` is a BlipForConditionalGeneration with a locally written WordPiece vocabulary
(its captions are gibberish, the plumbing is the real one); `builtin:tiny-clipseg` is a
CLIPSegForImageSegmentation over the project's tiny CLIP tokenizer. Both are saved with
`save_pretrained` and loaded back through `from_pretrained`, the path a real model takes.
"""
from __future__ import annotations

from pathlib import Path

TINY_BLIP = "builtin:tiny-blip"
TINY_CLIPSEG = "builtin:tiny-clipseg"
SEED = 0
_SIZE, _PATCH = 32, 8
_TOWER = dict(hidden_size=32, intermediate_size=37, num_attention_heads=4, num_hidden_layers=2)
_WORDS = (
    "a", "photo", "of", "the", "toy", "on", "table", "with", "red", "blue", "green", "small",
    "sitting", "in", "and", "white", "background", "close", "up", "stuffed", "plush", "bear",
)


def build_tiny_blip(out: Path) -> Path:
    """BLIP captioner: ViT 32 px / 8 px patches, 2-layer text decoder, ~80-token vocabulary."""
    import torch
    from transformers import (
        BertTokenizer,
        BlipConfig,
        BlipForConditionalGeneration,
        BlipImageProcessorPil,
        BlipProcessor,
    )

    out.mkdir(parents=True, exist_ok=True)
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[DEC]", *_WORDS, *letters]
    tokens += [f"##{c}" for c in letters]
    vocab = {tok: i for i, tok in enumerate(dict.fromkeys(tokens))}
    tokenizer = BertTokenizer(vocab=vocab, bos_token="[DEC]")
    text = dict(
        vocab_size=len(vocab), encoder_hidden_size=_TOWER["hidden_size"], max_position_embeddings=64,
        bos_token_id=vocab["[DEC]"], pad_token_id=vocab["[PAD]"], sep_token_id=vocab["[SEP]"],
        eos_token_id=vocab["[SEP]"], **_TOWER,
    )
    config = BlipConfig(
        text_config=text, vision_config=dict(image_size=_SIZE, patch_size=_PATCH, **_TOWER),
        projection_dim=32,
    )
    torch.manual_seed(SEED)
    BlipForConditionalGeneration(config).save_pretrained(out)
    image_processor = BlipImageProcessorPil(size={"height": _SIZE, "width": _SIZE})
    BlipProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(out)
    return out


def build_tiny_clipseg(out: Path) -> Path:
    """CLIPSeg: CLIP towers 32 wide, 2 layers, 32 px input, a decoder reading layer 1."""
    import torch
    from transformers import (
        CLIPSegConfig,
        CLIPSegForImageSegmentation,
        CLIPSegProcessor,
        CLIPTokenizer,
        ViTImageProcessorPil,
    )

    vocab_size = _byte_clip_tokenizer(out)
    text = dict(
        vocab_size=vocab_size, max_position_embeddings=77, bos_token_id=vocab_size - 2,
        eos_token_id=vocab_size - 1, pad_token_id=vocab_size - 1, **_TOWER,
    )
    config = CLIPSegConfig(
        text_config=text, vision_config=dict(image_size=_SIZE, patch_size=_PATCH, **_TOWER),
        projection_dim=32, extract_layers=[1], reduce_dim=16, decoder_num_attention_heads=2,
        decoder_intermediate_size=32,
    )
    torch.manual_seed(SEED)
    CLIPSegForImageSegmentation(config).save_pretrained(out)
    image_processor = ViTImageProcessorPil(
        size={"height": _SIZE, "width": _SIZE},
        image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225],  # CLIPSeg's statistics
    )
    tokenizer = CLIPTokenizer.from_pretrained(out)
    CLIPSegProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(out)
    return out


def _byte_clip_tokenizer(out: Path) -> int:
    """A CLIP BPE tokenizer with the byte symbols and no merges (vocab.json, merges.txt)."""
    import json

    from transformers import CLIPTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    out.mkdir(parents=True, exist_ok=True)
    symbols = list(bytes_to_unicode().values())
    tokens = [*symbols, *(s + "</w>" for s in symbols), "<|startoftext|>", "<|endoftext|>"]
    (out / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(tokens)}, ensure_ascii=False))
    (out / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = CLIPTokenizer(str(out / "vocab.json"), str(out / "merges.txt"), model_max_length=77,
                              pad_token="<|endoftext|>")
    tokenizer.save_pretrained(out)
    return len(tokens)


BUILDERS = {TINY_BLIP: build_tiny_blip, TINY_CLIPSEG: build_tiny_clipseg}
