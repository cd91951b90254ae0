"""What a method caches before and during training: latents of fixed crops, text embeddings of
frozen encoders (then released), and the frozen parts placed first. A mixin of TrainingMethod."""
from __future__ import annotations

import hashlib
import io
import logging
import time
from typing import Any

import torch
from PIL import Image
from tqdm import tqdm

from tasks.common.memory import release_memory
from tasks.train.clips import clip_digest, clip_pixels
from tasks.train.concepts import concept_prompts
from tasks.train.data import latent_key, prepare_image
from tasks.train.diffusion import LatentCache, PromptCache
from tasks.train.methods.placement import put
from tasks.train.references import fill_references

log = logging.getLogger(__name__)


class Caches:
    """The latent and prompt caches (`latent_cache`, `prompt_cache` on TrainingMethod)."""

    def caches_prompts(self) -> bool:
        """True when the text embeddings are cached: the option is on, no text encoder trains, an
        image's prompt cannot change between epochs, and the text alone is the conditioning (not where
        the text encoder sees the reference images: Qwen-Image-Edit)."""
        trains_text = any(n.startswith("text_encoder") for n in self.trainable())
        return (self.cfg.cache_text_encoder_outputs and not trains_text and not self.prompts_vary()
                and not self.components.family.text.sees_references)

    def place_frozen_first(self, device: torch.device, dtype: torch.dtype) -> None:
        """Before the denoiser is loaded (core.py): the frozen parts already loaded (the VAE, the
        text encoders that do not train) go where `place` will put them, in the training precision,
        and their float32 weights back to the system. Loading and casting the denoiser is the
        process's memory peak (the file's pages and the cast copy together), so nothing else should
        be resident in float32 beside it. With the text cache on, the frozen text encoders then
        encode every prompt training can see and go: the largest (T5-XXL, 9.5 GB in bf16) and the
        denoiser are never in memory together."""
        trainable = set(self.trainable())
        for name in [n for n in self.components.modules if n not in trainable]:  # no loop variable keeps
            put(self.components.modules[name], name, device, dtype, trainable=False)  # T5 alive after
        release_memory()
        if self.caches_prompts():
            self.prompt_cache = self._new_prompt_cache()
            self.release_text_encoders(device)

    def _new_prompt_cache(self) -> PromptCache:
        text_store = None
        if self.cfg.cache_text_encoder_outputs_to_disk:
            from tasks.train.latent_store import DiskPromptStore

            c = self.components
            text_store = DiskPromptStore(self.cfg.disk_cache_dir, c.text_encoders, c.family.name,
                                         self.cfg.max_sequence_length)
        return PromptCache(text_store)

    def setup_caches(self) -> None:
        """Cache what cannot change: latents of fixed crops, embeddings of a frozen text encoder
        (already complete where `place_frozen_first` ran)."""
        self.latent_cache = None
        if self.cfg.cache_latents and self.cfg.center_crop:
            store = None
            if self.cfg.cache_latents_to_disk:
                from tasks.train.latent_store import DiskLatentStore

                store = DiskLatentStore(self.cfg.disk_cache_dir, self.components.modules["vae"])
                log.info("latent cache on disk: %s", store.folder)
            self.latent_cache = LatentCache(store, self.components.family.codec)
        if self.prompt_cache is None or not self.prompt_cache.complete:
            self.prompt_cache = self._new_prompt_cache() if self.caches_prompts() else None
        log.info("caching: latents %s, text embeddings %s",
                 "on" if self.latent_cache else "off" + (" (random crops)" if self.cfg.cache_latents else ""),
                 "on" if self.prompt_cache else "off" + (self._why_text_uncached()
                                                         if self.cfg.cache_text_encoder_outputs else ""))

    def _why_text_uncached(self) -> str:
        if self.components.family.text.sees_references:
            return f" ({self.components.family.title}'s text encoder sees each target's reference images)"
        return " (text encoder trains or tags shuffle)"

    def fill_latent_cache(self, dataset: Any, accelerator: Any) -> float:
        """Encode every latent an epoch can need before the first step, so that each step's time is
        what a long run will see (kohya's and SimpleTuner's caching pass); returns the seconds it took.
        With a disk store each rank encodes its share and reads the others' files; an entry already
        there (an earlier run's) is not decoded again. Same entries as filling during the first epoch."""
        if self.latent_cache is None or not hasattr(dataset, "latent_inputs"):
            return 0.0
        start = time.perf_counter()
        cache, vae = self.latent_cache, self.components.modules["vae"]
        hashes = getattr(cache.store, "hashes", None)
        todo = dataset.latent_inputs()
        if hashes is not None:
            todo = todo[accelerator.process_index::accelerator.num_processes]
        before = cache.misses
        bar = tqdm(todo, desc="latent cache", unit="image", disable=None if accelerator.is_local_main_process else True)
        with torch.no_grad(), accelerator.autocast():
            for record, target, flip in bar:
                if record.frames:  # a clip (tasks/train/clips.py): its own size, no crop, mask or references
                    key = latent_key(clip_digest(record.frames, hashes.digest if hashes is not None else None),
                                     target, flip)
                    if key not in cache.store:
                        cache.encode(vae, key, clip_pixels(record.frames, target, flip)[None], target, (0, 0))
                    continue
                data = None if hashes is not None else record.path.read_bytes()
                digest = hashes.digest(record.path) if hashes is not None else hashlib.sha256(data).hexdigest()
                mask_digest = dataset.mask_digest(record, hashes.digest if hashes is not None else None)
                key = latent_key(digest, target, flip, mask_digest)
                if record.references:  # edit training: the references' latents too
                    fill_references(cache, vae, record, target, flip, self.components.family)
                if key in cache.store:
                    continue
                with Image.open(io.BytesIO(data) if data is not None else record.path) as image:
                    pixels, original, crop = prepare_image(image, target, True, flip)
                mask = dataset.load_mask(record, original, target, crop, flip) if mask_digest else None
                cache.encode(vae, key, pixels[None], original, crop, mask)
        accelerator.wait_for_everyone()
        seconds = time.perf_counter() - start
        log.info("latent cache filled before the first step: %d of %d image crops encoded in %.1f s",
                 cache.misses - before, len(todo), seconds)
        return seconds

    def fixed_prompts(self) -> set[str]:
        """Every prompt a batch can hold when prompts do not vary (the instance prompt or the captions,
        the class prompt with prior preservation, '' with caption dropout)."""
        prompts = {self.cfg.instance_prompt} if self.caption_column is None else set(self.instance_texts)
        if self.cfg.with_prior_preservation:
            prompts.add(self.cfg.class_prompt)
        prompts |= concept_prompts(self.cfg, self.instance_texts)
        if self.cfg.proportion_empty_prompts > 0:
            prompts.add("")
        return prompts

    def release_text_encoders(self, device: torch.device | None = None) -> None:
        """With the text cache on: encode every prompt training will see, then let the frozen text
        encoders go before the first step, as diffusers' SD3/FLUX scripts do (FLUX's T5-XXL alone is
        9.5 GB in bf16). Validation images then load them from the base again. Nothing to do where
        `place_frozen_first` did it."""
        if self.prompt_cache is None or self.prompt_cache.complete:
            return
        start = time.perf_counter()
        c = self.components
        prompts = sorted(self.fixed_prompts())
        device = device or next(c.denoiser.parameters()).device
        with torch.no_grad():  # in chunks: with the disk store, memory stays flat for any number of captions
            for first in range(0, len(prompts), 64):
                chunk = prompts[first : first + 64]
                ids = c.family.text.tokenize(c, chunk, self.cfg.max_sequence_length)
                self.prompt_cache.lookup(chunk, ids, lambda one: c.family.text.encode_prompt(c, one), device)
        names = c.text_encoder_names()
        for name in names:
            del c.modules[name]
        c.text_encoders = []
        release_memory()
        self.prompt_cache.complete = True
        self.text_cache_seconds = time.perf_counter() - start
        log.info("text embeddings of %d prompt(s) cached in %.1f s; %s released before the first step", len(prompts),
                 self.text_cache_seconds, ", ".join(names))

    def disk_latents(self) -> Any:
        """The disk latent store the data loader may read instead of decoding images (None: decode all)."""
        store = self.latent_cache.store if self.latent_cache is not None else None
        return store if hasattr(store, "hashes") else None
