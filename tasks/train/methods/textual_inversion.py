"""Textual inversion (Gal et al. 2022): learn the embedding of a new token, nothing else (seed 000).

`placeholder_token` (plus `<token>_1 ... _{n-1}` for `num_vectors` > 1, as diffusers names them)
is added to every tokenizer and starts from the embedding of `initializer_token`. Prompts come
from diffusers' ImageNet templates ("a photo of a {}") for `learnable_property: object`, the style
templates for `style`. Only the placeholders' rows train: during training each text encoder's
token embedding is a `PlaceholderEmbedding` (the frozen matrix plus a small trainable [n, dim]
parameter for the placeholder ids), so the optimizer, the gradient and the clipping cover n rows
instead of the whole vocabulary (diffusers' textual_inversion.py trains the whole matrix and puts
every other row back after each step: 38M parameters for SD 1.5's CLIP, 49408 x 768).

Saves the full pipeline (extended tokenizers and text encoders) and `learned_embeds.safetensors`:
{placeholder_token: [num_vectors, dim]} for SD 1.x/2.x, which `pipe.load_textual_inversion()`
loads directly; {"clip_l": ..., "clip_g": ...} for SDXL, the layout SDXL embeddings are shared
in, loaded per text encoder (`load_textual_inversion(sd["clip_g"], token=..., text_encoder=
pipe.text_encoder_2, tokenizer=pipe.tokenizer_2)`).
"""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from finetune_runtime.layout import EMBEDS as EMBEDS_NAME
from tasks.common.errors import UserError
from tasks.train.data import Record
from tasks.train.methods.base import TrainingMethod
from tasks.train.models import Components

log = logging.getLogger(__name__)


OBJECT_TEMPLATES = [
    "a photo of a {}", "a rendering of a {}", "a cropped photo of the {}", "the photo of a {}",
    "a photo of a clean {}", "a photo of a dirty {}", "a dark photo of the {}", "a photo of my {}",
    "a photo of the cool {}", "a close-up photo of a {}", "a bright photo of the {}", "a cropped photo of a {}",
    "a photo of the {}", "a good photo of the {}", "a photo of one {}", "a close-up photo of the {}",
    "a rendition of the {}", "a photo of the clean {}", "a rendition of a {}", "a photo of a nice {}",
    "a good photo of a {}", "a photo of the nice {}", "a photo of the small {}", "a photo of the weird {}",
    "a photo of the large {}", "a photo of a cool {}", "a photo of a small {}",
]
STYLE_TEMPLATES = [
    "a painting in the style of {}", "a rendering in the style of {}", "a cropped painting in the style of {}",
    "the painting in the style of {}", "a clean painting in the style of {}", "a dirty painting in the style of {}",
    "a dark painting in the style of {}", "a picture in the style of {}", "a cool painting in the style of {}",
    "a close-up painting in the style of {}", "a bright painting in the style of {}",
    "a good painting in the style of {}", "a rendition in the style of {}", "a nice painting in the style of {}",
    "a small painting in the style of {}", "a weird painting in the style of {}",
    "a large painting in the style of {}",
]


class PlaceholderEmbedding(torch.nn.Module):
    """A token embedding whose placeholder rows are a separate trainable parameter.

    `weight` is the frozen matrix (the placeholders' rows in it are not read); `rows` [n, dim] are
    the placeholders' vectors, in the order of `ids`. `merged()` gives back a plain `nn.Embedding`.
    """

    def __init__(self, embedding: torch.nn.Embedding, ids: list[int]) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(embedding.weight.detach(), requires_grad=False)
        self.rows = torch.nn.Parameter(embedding.weight.detach()[ids].clone())
        slot = torch.full((embedding.num_embeddings,), -1, dtype=torch.long)
        slot[ids] = torch.arange(len(ids))
        self.register_buffer("slot", slot, persistent=False)  # token id -> row in `rows`, or -1
        self.ids = list(ids)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = F.embedding(input_ids, self.weight)
        slot = self.slot[input_ids]
        learned = F.embedding(slot.clamp(min=0), self.rows).to(out.dtype)
        return torch.where((slot >= 0).unsqueeze(-1), learned, out)

    def merged(self) -> torch.nn.Embedding:
        weight = self.weight.detach().clone()
        weight[self.ids] = self.rows.detach().to(weight.dtype)
        return torch.nn.Embedding.from_pretrained(weight, freeze=False)


class TextualInversion(TrainingMethod):
    name = "textual_inversion"

    def __init__(self, cfg) -> None:  # type: ignore[no-untyped-def]
        super().__init__(cfg)
        token = cfg.placeholder_token
        self.tokens = [token] + [f"{token}_{i}" for i in range(1, cfg.num_vectors)]
        self.templates = OBJECT_TEMPLATES if cfg.learnable_property == "object" else STYLE_TEMPLATES
        self.token_ids: list[list[int]] = []

    def bind(self, components: Components) -> None:
        """Add the placeholder tokens to every tokenizer and start them from the initializer's embedding."""
        super().bind(components)
        for tokenizer, encoder in zip(components.tokenizers, components.text_encoders):
            init = tokenizer.encode(self.cfg.initializer_token, add_special_tokens=False)
            if len(init) != 1:
                raise UserError(f"train.initializer_token {self.cfg.initializer_token!r} is {len(init)} tokens for "
                                "this tokenizer; pick one word that is a single token (e.g. 'toy', 'dog', 'style')")
            if tokenizer.add_tokens(self.tokens) != len(self.tokens):
                raise UserError(f"train.placeholder_token {self.cfg.placeholder_token!r} (or one of its _1.._n "
                                "forms) is already a token; pick a new string such as '<my-concept>'")
            ids = tokenizer.convert_tokens_to_ids(self.tokens)
            encoder.resize_token_embeddings(len(tokenizer), mean_resizing=False)
            with torch.no_grad():
                weight = encoder.get_input_embeddings().weight
                weight[ids] = weight[init[0]].clone()
            self.token_ids.append(ids)
        log.info("textual inversion: %d new token(s) %s, initialised from %r", len(self.tokens),
                 " ".join(self.tokens), self.cfg.initializer_token)

    def trainable(self) -> list[str]:
        return self.components.text_encoder_names()

    def configure(self) -> None:
        """Only the placeholders' rows train; everything else is frozen (and in eval mode)."""
        c = self.components
        for module in c.modules.values():
            module.requires_grad_(False)
            module.eval()
        for encoder, ids in zip(c.text_encoders, self.token_ids):
            encoder.train()
            embedding = encoder.get_input_embeddings()
            if isinstance(embedding, PlaceholderEmbedding):  # configured before (a resume in one process)
                embedding = embedding.merged()
            encoder.set_input_embeddings(PlaceholderEmbedding(embedding, ids))
        if self.cfg.gradient_checkpointing:
            c.denoiser.enable_gradient_checkpointing()
            for encoder in c.text_encoders:
                encoder.gradient_checkpointing_enable()

    def prompt(self, record: Record, rng: np.random.Generator) -> str:
        return self.templates[int(rng.integers(len(self.templates)))].format(" ".join(self.tokens))

    def prompts_vary(self) -> bool:
        return True

    def validation_prompts(self) -> list[str]:
        return [self.templates[0].format(self.cfg.placeholder_token)]

    def learned_embeds(self, trained: dict[str, torch.nn.Module]) -> dict[str, torch.Tensor]:
        """The placeholder rows, keyed as the family's embedding files key them (`embedding_keys`)."""
        rows = [_placeholder_rows(trained[name], ids).detach().float().cpu().contiguous()
                for name, ids in zip(self.components.text_encoder_names(), self.token_ids)]
        keys = self.components.family.text.embedding_keys
        if keys is not None:
            return dict(zip(keys, rows))
        return {self.cfg.placeholder_token: rows[0]}

    def save(self, base: Path, out_dir: Path, trained: dict[str, torch.nn.Module]) -> None:
        from safetensors.torch import save_file

        for name in self.components.text_encoder_names():  # a plain embedding in the saved encoder
            embedding = trained[name].get_input_embeddings()
            if isinstance(embedding, PlaceholderEmbedding):
                trained[name].set_input_embeddings(embedding.merged())
        super().save(base, out_dir, trained)
        save_file(self.learned_embeds(trained), out_dir / EMBEDS_NAME, metadata={"format": "pt"})
        log.info("saved the learned embedding of %s to %s", self.cfg.placeholder_token, out_dir / EMBEDS_NAME)


def _placeholder_rows(encoder: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """The learned vectors of `ids`, from the training-time embedding or a plain (merged) one."""
    embedding = encoder.get_input_embeddings()
    return embedding.rows if isinstance(embedding, PlaceholderEmbedding) else embedding.weight[ids]
