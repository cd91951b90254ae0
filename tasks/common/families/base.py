"""What a model family says about itself, and the parts of a base model that training holds.

A family is one module under tasks/common/families/ with one `ModelFamily` subclass: how it is
recognised in a diffusers folder, its diffusers and optimum-intel pipeline classes, its built-in
tiny model, how a prompt becomes conditioning, how the denoiser is called, the training objective,
which methods and options apply, the LoRA targets and the single-file layout. Stages never test a
family's name; they ask the family.

Everything here imports torch, diffusers and transformers lazily: the stages that only need to
know a family's name or classes (base, export, evaluate) pay for nothing else.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

from finetune_runtime import pipeline_call
from finetune_runtime.convention import MAX_INPUT_IMAGES, CallConvention
from tasks.common.families.export_profile import ExportProfile
from tasks.common.families.latent_codec import LatentCodec
from tasks.common.families.text_conditioner import TextConditioner

log = logging.getLogger(__name__)


@dataclass
class Components:
    """Tokenizers, text encoders, VAE, denoiser and training noise scheduler of one base model.

    `modules` names every torch module as in the pipeline folder ("unet" or "transformer", "vae",
    "text_encoder", "text_encoder_2", ...), which is how methods and checkpoints refer to them.
    """

    family: type[ModelFamily]
    tokenizers: list[Any]
    text_encoders: list[Any]
    vae: Any
    denoiser: Any  # None until `load_denoiser` where it was loaded without (load_components(denoiser=False))
    noise_scheduler: Any
    modules: dict[str, Any] = field(default_factory=dict)
    #: the denoiser's config.json (readable before its weights are loaded)
    denoiser_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        f = self.family
        self.modules = {**({f.denoiser_name: self.denoiser} if self.denoiser is not None else {}), "vae": self.vae,
                        **dict(zip(f.text.encoder_names, self.text_encoders))}
        if self.denoiser is not None:
            self.denoiser_config = dict(self.denoiser.config)

    def load_denoiser(self, base: Path, dtype: Any = None, quantize: Any = None) -> None:
        """Load the denoiser's weights now (after the prompts are encoded, the text encoders gone);
        `dtype`: straight into that precision (where training keeps the denoiser's weights frozen);
        `quantize` (tasks/common/quantize.BasePrecision): its Linear layers quantized as they load."""
        if self.denoiser is None:
            self.denoiser = self.family.load_denoiser(base, dtype, quantize)
            self.modules = {self.family.denoiser_name: self.denoiser, **self.modules}

    def text_encoder_names(self) -> list[str]:
        return list(self.family.text.encoder_names[: len(self.text_encoders)])

    def trainable_text_encoder_names(self) -> list[str]:
        allowed = self.family.text.trainable
        return [n for n in self.text_encoder_names() if allowed is None or n in allowed]

    def keep_only(self, names: set[str] | list[str]) -> None:
        """Drop every module not in `names` (after training: what the output no longer needs from
        memory); family, tokenizers and scheduler stay. Kept text encoders keep their order."""
        kept_encoders = [n for n in self.text_encoder_names() if n in names]
        self.modules = {n: m for n, m in self.modules.items() if n in names}
        self.text_encoders = [self.modules[n] for n in kept_encoders]
        self.vae = self.modules.get("vae")
        self.denoiser = self.modules.get(self.family.denoiser_name)


@dataclass(frozen=True)
class PredictInputs:
    """What a family's denoiser call (`ModelFamily.predict`) reads beyond the noisy latents, the
    timesteps and the prompt embeddings."""

    #: train.resolution (SDXL's target size where a row has none)
    resolution: int
    #: the guidance input of guidance-distilled bases (FLUX); others have none
    guidance_scale: float
    #: SDXL's micro-conditioning per row, (n, 2) long tensors: source size, crop corner, target size
    original_sizes: Any = None
    crops_top_left: Any = None
    target_sizes: Any = None
    #: edit training: the scaled latents of each reference image ([n, C, h, w] per reference), or None
    references: Any = None


class ModelFamily:
    """One model family. Subclasses set the class attributes and override what differs."""

    #: short name used in reports, tags and params checks ("sd", "sdxl", "sd3", "flux")
    name: ClassVar[str]
    #: a human name for messages
    title: ClassVar[str]
    #: `base.model` value of the built-in tiny model
    builtin: ClassVar[str]
    #: diffusers pipeline class names (model_index.json `_class_name`) this family loads
    pipeline_class_names: ClassVar[tuple[str, ...]]
    #: the denoiser's folder in the pipeline ("unet" or "transformer")
    denoiser_name: ClassVar[str] = "unet"
    #: how a prompt becomes conditioning: text encoders and tokenizers, tokenizing, encoding, which train
    text: ClassVar[TextConditioner] = TextConditioner()
    #: "ddpm" (noise or v prediction on a DDPM schedule) or "flow_matching" (rectified flow): the name
    #: of the objective in tasks/train/objectives.py's OBJECTIVES; `objective_options()` says its settings
    objective: ClassVar[str] = "ddpm"
    #: how pixels become the denoiser's latents: the VAE's input, the latents' scaling, the pixel multiple
    codec: ClassVar[LatentCodec] = LatentCodec()
    #: trains on (reference images, target, instruction) triples: reference latents join the denoiser's
    #: input sequence (ingest's `reference_file_names`); a family without refuses a dataset that has them
    takes_references: ClassVar[bool] = False
    #: a video model: trains on clips (ingest's clips.jsonl, pixels (3, F, H, W)), its pipeline makes clips
    video: ClassVar[bool] = False
    #: a new text embedding trains here (what textual inversion needs; tasks/train/method_specs/ asks)
    trains_embeddings: ClassVar[bool] = True
    #: peft target modules of the denoiser's attention projections (the text encoders': `text.lora_targets`)
    lora_targets: ClassVar[tuple[str, ...]] = ("to_k", "to_q", "to_v", "to_out.0")
    #: train.launcher xla (PyTorch/XLA SPMD) has been run on this family's tiny model
    xla_tested: ClassVar[bool] = True
    #: classifier-free guidance runs the denoiser on a doubled batch (FLUX.1's distilled guidance does not)
    guidance_in_batch: ClassVar[bool] = True
    #: how a fine-tune leaves training: OpenVINO pipeline, GenAI and ComfyUI adapter keys, single file
    export: ClassVar[ExportProfile] = ExportProfile(ov_pipeline=None)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """The family's title in its roles' messages."""
        super().__init_subclass__(**kwargs)
        if "title" in vars(cls) or "export" in vars(cls):
            cls.export = replace(cls.export, title=getattr(cls, "title", cls.export.title))
        if "title" in vars(cls) or "text" in vars(cls):
            cls.text = replace(cls.text, title=getattr(cls, "title", cls.text.title))

    # --- recognising a folder -------------------------------------------------------------------
    @classmethod
    def matches(cls, index: dict[str, Any]) -> bool:
        """True when a model_index.json belongs to this family."""
        return index.get("_class_name") in cls.pipeline_class_names

    # --- classes --------------------------------------------------------------------------------
    @classmethod
    def pipeline_class(cls) -> type:
        import diffusers

        return getattr(diffusers, cls.pipeline_class_names[0])

    # --- the built-in tiny model -----------------------------------------------------------------
    @classmethod
    def build_tiny(cls, seed: int) -> Any:
        """The family's toy-sized pipeline, every weight drawn from `seed`."""
        raise NotImplementedError

    # --- training parts --------------------------------------------------------------------------
    @classmethod
    def load_components(cls, base: Path, prediction_type: str | None = None, denoiser: bool = True,
                        text_quantize: Any = None) -> Components:
        """Every part of a base folder; text encoders and tokenizers in `text.encoder_names` order.
        `denoiser=False`: all but the denoiser's weights (`Components.load_denoiser` loads them later).
        `text_quantize` (a BasePrecision): the text encoders' Linear layers quantized as they load, in
        bf16 (tasks/common/weights_load.py, as the denoiser)."""
        import diffusers
        import torch
        import transformers

        base = Path(base)
        index = _index(base)
        tokenizers, encoders = [], []
        for tok_name, enc_name in zip(cls.text.tokenizer_names, cls.text.encoder_names):
            if (index.get(enc_name) or [None])[0] is None:
                continue  # an optional encoder left out (SD3 without T5)
            tokenizers.append(_library_class(index[tok_name]).from_pretrained(base, subfolder=tok_name))
            encoder_class = getattr(transformers, index[enc_name][1])
            if text_quantize is None:
                encoders.append(encoder_class.from_pretrained(base, subfolder=enc_name))
            else:  # a chunk at a time, each chunk's bf16 weights given back once quantized
                from tasks.common.weights_load import load_in_dtype

                encoders.append(load_in_dtype(encoder_class, base, enc_name, torch.bfloat16, text_quantize))
        vae = getattr(diffusers, index["vae"][1]).from_pretrained(base, subfolder="vae")
        scheduler = cls.noise_scheduler(base, prediction_type)
        if not denoiser:
            config = getattr(diffusers, index[cls.denoiser_name][1]).load_config(base, subfolder=cls.denoiser_name)
            log.info("loaded %s base model from %s (%s objective; %s later)", cls.title, base, cls.objective,
                     cls.denoiser_name)
            return Components(cls, tokenizers, encoders, vae, None, scheduler, denoiser_config=dict(config))
        log.info("loaded %s base model from %s (%s objective)", cls.title, base, cls.objective)
        return Components(cls, tokenizers, encoders, vae, cls.load_denoiser(base), scheduler)

    @classmethod
    def load_denoiser(cls, base: Path, dtype: Any = None, quantize: Any = None) -> Any:
        """The denoiser (UNet or transformer) of a base folder, in the precision diffusers loads it
        in, or in `dtype` (a frozen denoiser: loaded tensor by tensor, never the whole file beside it);
        `quantize`: a frozen denoiser's Linear layers quantized as they load."""
        import diffusers
        import torch

        index = _index(Path(base))
        model_class = getattr(diffusers, index[cls.denoiser_name][1])
        if dtype is None and quantize is None:
            return model_class.from_pretrained(base, subfolder=cls.denoiser_name)
        from tasks.common.weights_load import load_in_dtype

        return load_in_dtype(model_class, base, cls.denoiser_name, dtype or torch.float32, quantize)

    @classmethod
    def refused_options(cls) -> dict[str, str]:
        """train.* keys this family refuses when they are set away from their default (key: why):
        here the flow-matching ones, which a DDPM family has no use for."""
        why = f"a flow-matching option (SD3, FLUX); {cls.title} trains with DDPM noise"
        keys = ("weighting_scheme", "logit_mean", "logit_std", "mode_scale", "max_sequence_length",
                "timestep_sampling", "sigmoid_scale", "timestep_shift")
        return {**dict.fromkeys(keys, why), **video_option_refusals(cls),
                "guidance_scale": f"the guidance input of guidance-distilled FLUX bases; {cls.title} has none"}

    @classmethod
    def objective_options(cls) -> dict[str, Any]:
        """The objective's own train.* settings, with the value this family gives each where the
        config leaves it null (flow matching: `weighting_scheme`); DDPM has none."""
        return {}

    @classmethod
    def noise_scheduler(cls, base: Path, prediction_type: str | None) -> Any:
        """The scheduler training draws timesteps and noise levels from: DDPM with the base's betas
        (the UNet families), optionally with another prediction target."""
        from diffusers import DDPMScheduler

        scheduler = DDPMScheduler.from_pretrained(base, subfolder="scheduler")
        if prediction_type is not None:
            scheduler.register_to_config(prediction_type=prediction_type)
        return scheduler

    @classmethod
    def prepare_base(cls, folder: Path) -> None:
        """Make a base folder the base stage wrote (downloaded, copied or built) loadable here; nothing
        for most families (Qwen-Image-Edit names a processor that needs no torchvision)."""

    @classmethod
    def reference_pixels(cls, pixels: Any) -> Any:
        """A training reference (1, 3, H, W) in [-1, 1] as the pipeline encodes an input image of it
        (here: as it is; Qwen-Image-Edit scales it to a megapixel)."""
        return pixels

    @classmethod
    def predict(cls, denoiser: Any, noisy_latents: Any, timesteps: Any, hidden: Any, pooled: Any,
                inputs: PredictInputs) -> Any:
        """The denoiser's prediction, in the latents' shape."""
        raise NotImplementedError

    @classmethod
    def lora_components(cls, trained: list[str]) -> list[str]:
        """Pipeline components that carry LoRA layers, for `fuse_lora(components=...)`."""
        return [cls.denoiser_name, *(n for n in trained if n.startswith("text_encoder"))]

    # --- inference ------------------------------------------------------------------------------
    @classmethod
    def generate(cls, pipe: Any, prompts: list[str] | str, *, steps: int, latents: Any = None,
                 extra: dict[str, Any] | None = None, **settings: Any) -> list[Any]:
        """Images of one call of `pipe` (this family's diffusers or OpenVINO pipeline, or a GenAI
        stand-in): `settings` as finetune_runtime/pipeline_call.call_arguments takes them (height, width,
        guidance, negative, generator, images_per_prompt, output_type, callback, image); None leaves the
        pipeline's default, the size excepted (finetune_runtime/size.py decides it). Every stage and the served
        model call pipelines through finetune_runtime/pipeline_call.py."""
        return pipeline_call.generate(pipe, prompts, cls.call_convention(), steps=steps, latents=latents, extra=extra,
                                      **settings)

    @classmethod
    def call_convention(cls) -> CallConvention:
        """How this family's pipeline is called (recorded with a registered model, whose served code
        cannot import the families)."""
        return CallConvention(input_images=MAX_INPUT_IMAGES if cls.takes_references else 0,
                               latent_patch=max(1, cls.codec.pixel_multiple // 8))

    @classmethod
    def class_images_refusal(cls) -> str | None:
        """Why prior preservation's class images cannot be made with this family (None: they can)."""
        if cls.call_convention().min_input_images:
            return f"{cls.title} makes no image from a prompt alone, so it cannot make class images"
        return None

    @classmethod
    def latent_shape(cls, pipe: Any, height: int, width: int) -> tuple[int, ...]:
        """One image's starting noise as the pipeline's `latents` argument takes it (no batch axis)."""
        channels = int(getattr(pipe, cls.denoiser_name).config["in_channels"])
        vsf = int(pipe.vae_scale_factor)
        return (channels, height // vsf, width // vsf)


def video_option_refusals(family: type[ModelFamily]) -> dict[str, str]:
    """The train.* keys only a video family reads (key: why), refused by every other family (each
    family's `refused_options()` includes them)."""
    if family.video:
        return {}
    return {"first_frame_conditioning_p": "trains a video family's clips as image-to-video (their first frame "
                                          f"kept clean); {family.title} makes images, not clips"}


def _library_class(entry: list[str]) -> Any:
    """The class a model_index.json entry ([library, class name]) names: transformers' by name, or
    one of a module the pipeline recorded (Qwen-Image-Edit's finetune_runtime.vl_processor)."""
    import importlib

    return getattr(importlib.import_module(entry[0]), entry[1])


def _index(base: Path) -> dict[str, Any]:
    import json

    return json.loads((Path(base) / "model_index.json").read_text())
