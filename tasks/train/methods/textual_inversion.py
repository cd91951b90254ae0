"""Textual inversion (Gal et al. 2022): learn the embedding of a new token, nothing else (seed 000).

`placeholder_token` (plus `<token>_1 ... _{n-1}` for `num_vectors` > 1, as diffusers names them)
is added to every tokenizer and starts from the embedding of `initializer_token`. Prompts come
from diffusers' ImageNet templates ("a photo of a {}") for `learnable_property: object`, the style
templates for `style`. After each optimizer step every other row of the embedding matrix is put
back (weight decay and Adam touch all rows), as in diffusers' textual_inversion.py.

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

from tasks.common.errors import UserError
from tasks.train.data import Record
from tasks.train.methods.base import TrainingMethod
from tasks.train.models import Components

log = logging.getLogger(__name__)

EMBEDS_NAME = "learned_embeds.safetensors"

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


class TextualInversion(TrainingMethod):
    name = "textual_inversion"

    def __init__(self, cfg) -> None:  # type: ignore[no-untyped-def]
        super().__init__(cfg)
        token = cfg.placeholder_token
        self.tokens = [token] + [f"{token}_{i}" for i in range(1, cfg.num_vectors)]
        self.templates = OBJECT_TEMPLATES if cfg.learnable_property == "object" else STYLE_TEMPLATES
        self.token_ids: list[list[int]] = []
        self.original: list[torch.Tensor] = []

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
        """Only the token embedding matrices train; everything else is frozen (and in eval mode)."""
        c = self.components
        for module in c.modules.values():
            module.requires_grad_(False)
            module.eval()
        self.original = []
        for encoder in c.text_encoders:
            encoder.train()
            weight = encoder.get_input_embeddings().weight
            weight.requires_grad_(True)
            self.original.append(weight.detach().clone())
        if self.cfg.gradient_checkpointing:
            c.denoiser.enable_gradient_checkpointing()
            for encoder in c.text_encoders:
                encoder.gradient_checkpointing_enable()

    def after_step(self) -> None:
        """Put back every embedding row but the placeholders' (the optimizer touched them all)."""
        with torch.no_grad():
            for encoder, original, ids in zip(self.components.text_encoders, self.original, self.token_ids):
                weight = encoder.get_input_embeddings().weight
                keep = torch.ones(weight.shape[0], dtype=torch.bool, device=weight.device)
                keep[ids] = False
                weight[keep] = original[keep].to(weight.device, weight.dtype)

    def release(self, keep: set[str] | list[str] = ()) -> None:
        super().release(keep)
        self.original = []  # the copies of the embedding matrices after_step restored from

    def prompt(self, record: Record, rng: np.random.Generator) -> str:
        return self.templates[int(rng.integers(len(self.templates)))].format(" ".join(self.tokens))

    def prompts_vary(self) -> bool:
        return True

    def validation_prompts(self) -> list[str]:
        return [self.templates[0].format(self.cfg.placeholder_token)]

    def learned_embeds(self, trained: dict[str, torch.nn.Module]) -> dict[str, torch.Tensor]:
        """The placeholder rows, keyed as the family's embedding files key them (`embedding_keys`)."""
        rows = [trained[name].get_input_embeddings().weight[ids].detach().float().cpu().contiguous()
                for name, ids in zip(self.components.text_encoder_names(), self.token_ids)]
        keys = self.components.family.embedding_keys
        if keys is not None:
            return dict(zip(keys, rows))
        return {self.cfg.placeholder_token: rows[0]}

    def save(self, base: Path, out_dir: Path, trained: dict[str, torch.nn.Module]) -> None:
        from safetensors.torch import save_file

        super().save(base, out_dir, trained)
        save_file(self.learned_embeds(trained), out_dir / EMBEDS_NAME, metadata={"format": "pt"})
        log.info("saved the learned embedding of %s to %s", self.cfg.placeholder_token, out_dir / EMBEDS_NAME)
