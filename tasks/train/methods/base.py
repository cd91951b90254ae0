"""The interface between a training method and the shared loop, with the shared behaviour.

A method says what is trainable (`configure`, `trainable`), what prompt each instance image gets
(`prompt`), what to do after an optimizer step (`after_step`) and how to save (`save` from the
trained modules, then `complete_output` from files once they have left memory). The shared
behaviour lives in one room each: data and batches (assembly.py), caches (caches.py), the loss
(loss.py), the output (saving.py), precision placement (placement.py); this class holds the state
and what is trained.
"""
from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Any, ClassVar

import torch

from tasks.train.config import TrainConfig
from tasks.train.data import CaptionPolicy
from tasks.train.diffusion import LatentCache, PromptCache
from tasks.train.methods.assembly import DataAssembly
from tasks.train.methods.caches import Caches
from tasks.train.methods.loss import Loss
from tasks.train.methods.placement import put
from tasks.train.methods.saving import Saving
from tasks.train.models import Components
from tasks.train.objectives import make_objective

log = logging.getLogger(__name__)


class TrainingMethod(DataAssembly, Caches, Loss, Saving):
    """Shared behaviour; subclasses override only what differs.

    Modules are named as in the diffusers pipeline folder ("unet" or "transformer", "vae",
    "text_encoder", "text_encoder_2", ...); the family (`components.family`) says how they are called.
    The loop prepares the `trainable()` ones with accelerate and passes the
    prepared (possibly wrapped) modules back to `compute_loss`.
    """

    name: ClassVar[str]

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self._components: Components | None = None
        column = cfg.caption_column or cfg.spec.default_caption_column  # (the spec's: full reads 'text')
        self.caption_column = column
        self.captions = CaptionPolicy(cfg.shuffle_tag_p, cfg.keep_tokens, cfg.proportion_empty_prompts)
        self.latent_cache: LatentCache | None = None
        self.prompt_cache: PromptCache | None = None
        self.text_cache_seconds = 0.0  # encoding every prompt before the first step (release_text_encoders)
        self.sample_captions: list[str] = []
        self.instance_texts: set[str] = set()
        self.class_files: list[Path] = []  # the concepts' class images' metadata files (part of the run key)
        self.concept_prompts: list[str] = []  # validation: one prompt per concept
        self.concepts_seen: Counter = Counter()  # instance examples per concept through compute_loss

    @property
    def components(self) -> Components:
        """The base model's parts; bound after the data is checked, so bad inputs fail fast."""
        if self._components is None:
            raise RuntimeError(f"{type(self).__name__}: bind(components) before training")
        return self._components

    def bind(self, components: Components) -> None:
        self._components = components
        self.objective = make_objective(components.family, components.noise_scheduler, self.cfg)

    # --- what is trained -------------------------------------------------------------------
    def trainable(self) -> list[str]:
        """Names of the modules with trainable weights (the denoiser, plus the text encoders on request)."""
        c = self.components
        return [c.family.denoiser.name, *(c.trainable_text_encoder_names() if self.cfg.train_text_encoder else [])]

    def denoiser_load_dtype(self, dtype: torch.dtype, device: torch.device) -> torch.dtype | None:
        """The precision to load the denoiser in: the training precision where its weights stay
        frozen or train in bf16 (`place` would cast them to it anyway; loading straight into it
        halves the load's peak), None (as stored) where it trains in float32."""
        frozen = self.components.family.denoiser.name not in self.trainable()
        bf16 = dtype == torch.bfloat16 and self.cfg.bf16_weights(device.type)
        return dtype if (frozen or bf16) and dtype != torch.float32 else None

    def configure(self) -> None:
        """Freeze everything, then unfreeze and switch to train mode what `trainable()` names."""
        names = set(self.trainable())
        for name, module in self.components.modules.items():
            module.requires_grad_(name in names)
            module.train(name in names)
        self._checkpointing()

    def _checkpointing(self) -> None:
        if self.cfg.gradient_checkpointing:
            self.components.denoiser.enable_gradient_checkpointing()
            for name in self.components.trainable_text_encoder_names() if self.cfg.train_text_encoder else []:
                self.components.modules[name].gradient_checkpointing_enable()

    def place(self, device: torch.device, dtype: torch.dtype) -> None:
        """Frozen modules in the low precision (they only run forward), trained ones in float32, or
        in bf16 too with `full_bf16` (tasks/train/bf16_adamw.py then updates them)."""
        trainable = set(self.trainable())
        bf16 = dtype == torch.bfloat16 and self.cfg.bf16_weights(device.type)
        for name, module in self.components.modules.items():
            put(module, name, device, dtype, name in trainable and not bf16)
        if bf16:
            log.info("full_bf16: %s trained in bf16 with stochastic rounding", ", ".join(sorted(trainable)))
        if self.cfg.channels_last:
            for name in (self.components.family.denoiser.name, "vae"):
                self.components.modules[name].to(memory_format=torch.channels_last)

    def param_groups(self) -> list[dict[str, Any]]:
        """Optimizer parameter groups (one group with every trainable parameter by default)."""
        params = [p for n in self.trainable() for p in self.components.modules[n].parameters() if p.requires_grad]
        return [{"params": params}]

    def after_step(self) -> None:
        """Called after each optimizer step (textual inversion restores the other embeddings)."""
