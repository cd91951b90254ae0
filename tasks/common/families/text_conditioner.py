"""A family's text conditioner: how a prompt becomes conditioning, one of the roles a family is built from.

The text encoders and their tokenizers (folder names, in the order conditioning uses them), how
prompts are tokenized (CLIP to its 77 tokens, T5 or a chat template to a fixed length so that
the text cache's rows concatenate), how token ids become (sequence, pooled) embeddings (a masked
family puts its float (b, L) mask in the pooled slot), which encoders may train and where LoRA
goes on them, and how a textual-inversion embedding file is keyed. Training, the text cache,
textual inversion and loading a fine-tune's embeddings take the conditioner as one object
(`ModelFamily.text`).

A family writes its encoding as a subclass in its own module; one conditioner written once is
shared where families share an encoder (FLUX.1 Kontext takes FLUX.1's; the Qwen3 chat template is
`qwen3_chat.Qwen3Chat`, FLUX.2 [klein]'s and Z-Image's).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: CLIP's attention projections, where LoRA goes on a trainable text encoder
CLIP_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj")


@dataclass(frozen=True)
class TextConditioner:
    """The text side of one family (the defaults are SD's: one CLIP encoder)."""

    #: text encoder folders, in the order conditioning uses them; tokenizers follow the same order
    encoder_names: tuple[str, ...] = ("text_encoder",)
    tokenizer_names: tuple[str, ...] = ("tokenizer",)
    #: peft target modules of the text encoders' attention projections
    lora_targets: tuple[str, ...] = CLIP_LORA_TARGETS
    #: text encoders that train with train.text_encoder (None: all; T5 never does, as in diffusers' scripts)
    trainable: tuple[str, ...] | None = None
    #: keys of a textual-inversion embedding file per text encoder, in `encoder_names` order
    #: (None: one {token: rows} entry)
    embedding_keys: tuple[str, ...] | None = None
    #: the text encoder sees the reference images too (Qwen-Image-Edit): `encode_batch_text` takes them,
    #: and training does not cache text embeddings (a target's conditioning is its prompt and its references)
    sees_references: bool = False
    #: tokens per prompt of a fixed-length tokenizer (T5, a chat template) when train.max_sequence_length
    #: is null; None: CLIP's own 77 only
    max_sequence_length: int | None = None
    #: a new token's embedding trains in these encoders (textual inversion; tasks/train/method_specs/ asks)
    trains_embeddings: bool = True
    #: why no text encoder trains where `trainable` is empty (train.train_text_encoder is refused)
    frozen_because: str = "its text encoders stay frozen"
    #: the family's title, for messages (ModelFamily sets it)
    title: str = "this model family"

    def refused_options(self) -> dict[str, str]:
        """train.* keys refused for this text side (key: why): train_text_encoder where none trains."""
        if self.trainable != ():
            return {}
        return {"train_text_encoder": f"{self.title} trains the transformer only ({self.frozen_because})"}

    def tokenize(self, components: Any, prompts: list[str], max_sequence_length: int | None = None) -> list[Any]:
        """Token ids per tokenizer, padded/truncated to each tokenizer's max length (CLIP: 77)."""
        return [tok(prompts, padding="max_length", max_length=tok.model_max_length, truncation=True,
                    return_tensors="pt").input_ids
                for tok in components.tokenizers]

    def encode_prompt(self, components: Any, input_ids: list[Any], text_encoders: list[Any] | None = None
                      ) -> tuple[Any, Any]:
        """(sequence embeddings, pooled embeddings or None). `text_encoders` may be wrapped copies."""
        raise NotImplementedError

    def encode_batch_text(self, components: Any, prompts: list[str], input_ids: list[Any],
                          text_encoders: list[Any] | None = None, references: list[Any] | None = None
                          ) -> tuple[Any, Any]:
        """A training batch's text conditioning: `encode_prompt` of its token ids, except where the text
        encoder sees the rows' reference pixels too (`sees_references`)."""
        return self.encode_prompt(components, input_ids, text_encoders)


@dataclass(frozen=True)
class T5Text(TextConditioner):
    """CLIP tokenizers to their 77 tokens, the T5 one (`t5_tokenizer`) to `max_sequence_length`, capped
    by its model_max_length (SD3, FLUX.1, LTX-Video)."""

    #: the T5 tokenizer's folder
    t5_tokenizer: str = ""
    max_sequence_length: int | None = 77
    #: no textual inversion beside T5 (diffusers' SD3 and FLUX scripts have none; T5's embeddings would
    #: need their own file format)
    trains_embeddings: bool = False

    def tokenize(self, components: Any, prompts: list[str], max_sequence_length: int | None = None) -> list[Any]:
        out = []
        for name, tok in zip(self.tokenizer_names, components.tokenizers):
            length = tok.model_max_length
            if name == self.t5_tokenizer:
                length = min(max_sequence_length or self.max_sequence_length, tok.model_max_length)
            out.append(tok(prompts, padding="max_length", max_length=length, truncation=True,
                           return_tensors="pt").input_ids)
        return out
