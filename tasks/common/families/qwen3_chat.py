"""Qwen3 as a text conditioner (FLUX.2 [klein], Z-Image): written once, each family saying its two choices.

Each prompt is one user turn of the tokenizer's chat template with the assistant's turn opened,
thinking on or off (`enable_thinking`), padded to a fixed length (the text cache concatenates
rows); the decoder runs with its padding masked (the template never holds the pad token) and the
conditioning is read from chosen hidden states. Flux2KleinPipeline takes layers 9, 18 and 27 side
by side with thinking off; ZImagePipeline the second-to-last with thinking on.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tasks.common.families.text_conditioner import TextConditioner


@dataclass(frozen=True)
class Qwen3Chat:
    """The chat template's `enable_thinking`, and the hidden states (indices into the decoder's
    `hidden_states`, 0 the embeddings) the conditioning is made of."""

    thinking: bool
    layers: tuple[int, ...]

    def tokenize(self, tokenizer: Any, prompts: list[str], length: int) -> list[Any]:
        """[token ids (b, length)]: each prompt as a chat turn, padded or cut to `length`."""
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                               add_generation_prompt=True, enable_thinking=self.thinking)
                 for p in prompts]
        return [tokenizer(texts, padding="max_length", max_length=length, truncation=True,
                          return_tensors="pt").input_ids]

    def hidden_states(self, qwen: Any, input_ids: Any, pad_token_id: int) -> tuple[list[Any], Any]:
        """([the chosen hidden states, (b, L, width) each], the attention mask (b, L), bool)."""
        ids = input_ids.to(next(qwen.parameters()).device)
        mask = ids != pad_token_id
        out = qwen(input_ids=ids, attention_mask=mask.long(), output_hidden_states=True, use_cache=False)
        return [out.hidden_states[k] for k in self.layers], mask


@dataclass(frozen=True)
class Qwen3ChatText(TextConditioner):
    """A text conditioner on one Qwen3 encoder read through `chat`; a family writes how it combines the
    chosen hidden states (`encode_prompt`)."""

    chat: Qwen3Chat | None = None
    trains_embeddings: bool = False  # no textual inversion on a chat-template encoder

    def tokenize(self, components: Any, prompts: list[str], max_sequence_length: int | None = None) -> list[Any]:
        """Each prompt as a chat turn, padded to `max_sequence_length` (the family's where None)."""
        length = max_sequence_length or self.max_sequence_length
        return self.chat.tokenize(components.tokenizers[0], prompts, length)
