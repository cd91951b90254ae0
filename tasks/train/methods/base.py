"""The interface between a training method and the shared loop, with the shared behaviour.

A method says what is trainable (`configure`, `trainable`), what prompt each instance image gets
(`prompt`), what to do after an optimizer step (`after_step`) and how to save (`save` from the
trained modules, then `complete_output` from files once they have left memory). Data, loss (noise,
Min-SNR, prior preservation), caching and precision placement are shared here.
"""
from __future__ import annotations

import hashlib
import io
import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from PIL import Image
from tqdm import tqdm

from tasks.common.errors import UserError
from tasks.common.memory import release_memory
from tasks.common.quantize import has_quantized, place_quantized
from tasks.train.batch import Batch
from tasks.train.concepts import concept_layout, concept_prompts, concept_validation_prompts, log_concepts, weighted
from tasks.train.config import TrainConfig
from tasks.train.data import CaptionPolicy, Record, TrainDataset, collate, latent_key, prepare_image, read_imagefolder
from tasks.train.diffusion import LatentCache, PromptCache, RowRandom, encode_latents
from tasks.train.masks import check_masks, loss_weights
from tasks.train.models import Components, pipeline_from_modules
from tasks.train.objectives import make_objective

log = logging.getLogger(__name__)

INGEST_FIX = "Run the `ingest` stage (dvc repro ingest) with ingest.sources pointing at your images."
CLASS_FIX = ("Run the `class_images` stage (dvc repro class_images) with class_images.num_images > 0, "
             "or set train.with_prior_preservation: false in params.yaml.")


class TrainingMethod:
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
        return [c.family.denoiser_name, *(c.trainable_text_encoder_names() if self.cfg.train_text_encoder else [])]

    def denoiser_load_dtype(self, dtype: torch.dtype, device: torch.device) -> torch.dtype | None:
        """The precision to load the denoiser in: the training precision where its weights stay
        frozen or train in bf16 (`place` would cast them to it anyway; loading straight into it
        halves the load's peak), None (as stored) where it trains in float32."""
        frozen = self.components.family.denoiser_name not in self.trainable()
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
            _put(module, name, device, dtype, name in trainable and not bf16)
        if bf16:
            log.info("full_bf16: %s trained in bf16 with stochastic rounding", ", ".join(sorted(trainable)))
        if self.cfg.channels_last:
            for name in (self.components.family.denoiser_name, "vae"):
                self.components.modules[name].to(memory_format=torch.channels_last)

    def param_groups(self) -> list[dict[str, Any]]:
        """Optimizer parameter groups (one group with every trainable parameter by default)."""
        params = [p for n in self.trainable() for p in self.components.modules[n].parameters() if p.requires_grad]
        return [{"params": params}]

    def after_step(self) -> None:
        """Called after each optimizer step (textual inversion restores the other embeddings)."""

    # --- data --------------------------------------------------------------------------------
    def prompt(self, record: Record, rng: np.random.Generator) -> str:
        """The prompt of one instance image: the instance prompt, or its caption with the caption rules."""
        if self.caption_column is None:
            return "" if rng.random() < self.cfg.proportion_empty_prompts else self.cfg.instance_prompt
        return self.captions(record, rng)

    def prompts_vary(self) -> bool:
        """True when an image's prompt can change between epochs beyond caption dropout."""
        captioned = self.caption_column is not None or any(c.instance_prompt is None for c in self.cfg.concepts)
        return captioned and self.captions.varies

    def dataset(self, data_dir: Path, class_dir: Path | None) -> TrainDataset:
        """Instance images (and class images with prior preservation); UserError when inputs are missing."""
        instances = read_imagefolder(data_dir, "instance images", INGEST_FIX, self.caption_column or "text")
        self.sample_captions = [r.text for r in instances[:4]]
        self.concept_prompts = concept_validation_prompts(self.cfg, instances)
        self.instance_texts = {r.text for r in instances}
        classes, layout = None, None
        if self.cfg.concepts:  # several concepts: each its prompts, class images, repeats and weight
            layout, classes, self.class_files = concept_layout(self.cfg, instances, data_dir, class_dir, self.captions)
        elif self.cfg.with_prior_preservation:
            if class_dir is None or not Path(class_dir).is_dir():
                raise UserError(f"prior preservation is on but the class images folder {class_dir} does not exist. "
                                f"{CLASS_FIX}")
            classes = read_imagefolder(class_dir, "class images", CLASS_FIX)
            made_with = {r.text for r in classes} - {""}
            if made_with and made_with != {self.cfg.class_prompt}:
                log.warning("train.class_prompt %r differs from the prompt the class images were made with (%s); "
                            "set them equal (class_images.prompt)", self.cfg.class_prompt,
                            ", ".join(sorted(map(repr, made_with))))
            if len(classes) < len(instances):
                log.warning("only %d class images for %d instance images; the DreamBooth paper uses ~200",
                            len(classes), len(instances))
        log.info("%s data: %d instance images (prompts: %s)%s", self.name, len(instances),
                 f"column {self.caption_column!r}" if self.caption_column else repr(self.cfg.instance_prompt),
                 f", {len(classes)} class images" if classes else "")
        dataset = TrainDataset(instances, classes, self.prompt, self.cfg.class_prompt, self.cfg.resolution,
                               self.cfg.center_crop, self.cfg.random_flip, self.cfg.seed,
                               self.cfg.buckets() if self.cfg.enable_bucket else None, layout)
        log_concepts(self.cfg, dataset)
        if dataset.buckets:
            log.info("aspect-ratio buckets (height x width: instance images): %s",
                     ", ".join(f"{k}: {v}" for k, v in dataset.bucket_counts().items()))
        dataset.masked, dataset.unmasked_probability = check_masks(self.cfg, instances)
        return dataset

    def collate(self, examples: list[dict[str, Any]]) -> Batch:
        batch = collate(examples)
        batch.input_ids = self.components.family.tokenize(self.components, batch.prompts, self.cfg.max_sequence_length)
        return batch

    def validation_prompts(self) -> list[str]:
        """Prompts of the validation images when train.validation_prompts is null."""
        if self.concept_prompts:
            return self.concept_prompts
        if self.caption_column is not None and self.sample_captions:
            return self.sample_captions[:1]
        return [self.cfg.instance_prompt]

    # --- loss ----------------------------------------------------------------------------------
    def caches_prompts(self) -> bool:
        """True when the text embeddings are cached: the option is on, no text encoder trains, and an
        image's prompt cannot change between epochs."""
        trains_text = any(n.startswith("text_encoder") for n in self.trainable())
        return self.cfg.cache_text_encoder_outputs and not trains_text and not self.prompts_vary()

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
            _put(self.components.modules[name], name, device, dtype, trainable=False)  # T5 alive after
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
            self.latent_cache = LatentCache(store)
        if self.prompt_cache is None or not self.prompt_cache.complete:
            self.prompt_cache = self._new_prompt_cache() if self.caches_prompts() else None
        log.info("caching: latents %s, text embeddings %s",
                 "on" if self.latent_cache else "off" + (" (random crops)" if self.cfg.cache_latents else ""),
                 "on" if self.prompt_cache else "off" + (" (text encoder trains or tags shuffle)"
                                                         if self.cfg.cache_text_encoder_outputs else ""))

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
                data = None if hashes is not None else record.path.read_bytes()
                digest = hashes.digest(record.path) if hashes is not None else hashlib.sha256(data).hexdigest()
                mask_digest = dataset.mask_digest(record, hashes.digest if hashes is not None else None)
                key = latent_key(digest, target, flip, mask_digest)
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
                ids = c.family.tokenize(c, chunk, self.cfg.max_sequence_length)
                self.prompt_cache.lookup(chunk, ids, lambda one: c.family.encode_prompt(c, one), device)
        names = c.text_encoder_names()
        for name in names:
            del c.modules[name]
        c.text_encoders = []
        release_memory()
        self.prompt_cache.complete = True
        self.text_cache_seconds = time.perf_counter() - start
        log.info("text embeddings of %d prompt(s) cached in %.1f s; %s released before the first step", len(prompts),
                 self.text_cache_seconds, ", ".join(names))

    def compute_loss(
        self, batch: Batch, modules: dict[str, torch.nn.Module]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(loss to backpropagate, extra scalars to log, as 0-d tensors) for one micro-batch."""
        c, cfg = self.components, self.cfg
        rand = RowRandom(batch.noise_seeds)  # per example, any rank
        with torch.no_grad():
            scale = c.family.scale_latents
            if self.latent_cache is not None:
                latents = self.latent_cache.latents(modules["vae"], batch, rand, scale)
            else:
                latents = encode_latents(modules["vae"], batch.pixels, rand, scale)
        noised = self.objective.noise(latents, rand)
        family = c.family
        encoders = [modules[n] for n in c.text_encoder_names()]
        if self.prompt_cache is not None:
            with torch.no_grad():
                hidden, pooled = self.prompt_cache.lookup(
                    batch.prompts, batch.input_ids, lambda ids: family.encode_prompt(c, ids, encoders),
                    latents.device)
        else:
            hidden, pooled = family.encode_prompt(c, batch.input_ids, encoders)
        sample = noised.noisy_latents
        if cfg.channels_last:
            sample = sample.contiguous(memory_format=torch.channels_last)
        pred = family.predict(modules[family.denoiser_name], sample, noised.timesteps, hidden, pooled,
                              batch.predict_inputs(cfg.resolution, cfg.guidance_scale))
        losses = self.objective.loss(pred, noised, loss_weights(cfg, batch.masks, batch.mask_off, pred))
        losses = weighted(losses, batch, self.concepts_seen)  # each row's concept weight; examples counted
        n = batch.num_instances
        if n == losses.shape[0]:
            loss = losses.mean()
            return loss, {"instance_loss": loss.detach()}  # read after the step (XLA: no extra sync)
        instance_loss, prior_loss = losses[:n].mean(), losses[n:].mean()
        loss = instance_loss + cfg.prior_loss_weight * prior_loss
        return loss, {"instance_loss": instance_loss.detach(), "prior_loss": prior_loss.detach()}

    def images_in(self, batch: Batch) -> int:
        """Images one micro-batch pushes through the denoiser (for images/s)."""
        return len(batch.latent_keys)

    def disk_latents(self) -> Any:
        """The disk latent store the data loader may read instead of decoding images (None: decode all)."""
        store = self.latent_cache.store if self.latent_cache is not None else None
        return store if hasattr(store, "hashes") else None

    # --- output ----------------------------------------------------------------------------------
    def live_pipeline(self, base: Path, modules: dict[str, torch.nn.Module]) -> Any:
        """A pipeline over the modules being trained (validation images during training)."""
        return pipeline_from_modules(base, self.components, modules)

    def save(self, base: Path, out_dir: Path, trained: dict[str, torch.nn.Module]) -> None:
        """What the output needs from the trained modules: here a complete pipeline folder, the
        trained modules plus the base's other parts, safetensors. Only the trained modules are still
        in memory (the caller has released the rest); `complete_output` follows once they are gone."""
        # Only the trained modules come from memory; the frozen ones load from the base in their
        # stored precision (in memory they may be bf16).
        pipe = pipeline_from_modules(base, self.components, trained, keep_safety_checker=True)
        if self.cfg.prediction_type is not None:
            # Inference must predict what training taught: carry the target into the scheduler.
            pipe.scheduler = pipe.scheduler.__class__.from_config(
                pipe.scheduler.config, prediction_type=self.cfg.prediction_type
            )
        pipe.save_pretrained(out_dir, safe_serialization=True)
        log.info("saved %s pipeline (%s trained) to %s", self.name, ", ".join(sorted(trained)), out_dir)

    def complete_output(self, base: Path, out_dir: Path) -> None:
        """What the output still needs once the trained modules have left memory (`release`): parts
        made from the base and files already in `out_dir` alone (LoRA: the fused pipeline)."""

    def release(self, keep: set[str] | list[str] = ()) -> None:
        """After training: drop the caches and every module but those named in `keep`, so loading
        the base again (saving, the fused pipeline, final validation) does not sit beside them."""
        self.latent_cache = self.prompt_cache = None
        if self._components is not None:
            self._components.keep_only(set(keep))

    def load_output(self, out_dir: Path, base: Path) -> Any:
        """The saved output as a pipeline, through diffusers' own loaders (final validation)."""
        from diffusers import DiffusionPipeline

        return DiffusionPipeline.from_pretrained(out_dir)


def _put(module: torch.nn.Module, name: str, device: torch.device, dtype: torch.dtype, trainable: bool) -> None:
    """One module where training runs it: frozen ones in the low precision (they only run forward),
    trained ones in float32."""
    # fp16 VAEs overflow (SDXL's notably); bf16 has fp32's range.
    target = torch.float32 if trainable or (name == "vae" and dtype == torch.float16) else dtype
    if has_quantized(module):
        place_quantized(module, device, target)  # a quantized base: its 8/4-bit weights keep their format
    elif target == torch.float32:
        module.to(device)  # already fp32 (passing a dtype makes diffusers warn for nothing)
    else:
        module.to(device, dtype=target)
