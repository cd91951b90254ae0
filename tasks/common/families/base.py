"""What a model family says about itself, and the parts of a base model that training holds.

A family is one module under tasks/common/families/ with one `ModelFamily` subclass: how it is
recognised in a diffusers folder, its diffusers and optimum-intel pipeline classes, its built-in
tiny model, and its roles: which diffusers pipeline its folders are (`pipeline`), how a prompt
becomes conditioning (`text`), how pixels become latents (`codec`), how the denoiser is loaded,
trained and called (`denoiser`), the images its pipeline takes beside the prompt (`inputs`), how a
fine-tune leaves training (`export`). Stages never test a family's name; they ask the family.

Everything here imports torch, diffusers and transformers lazily: the stages that only need to
know a family's name or classes (base, export, evaluate) pay for nothing else.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

from finetune_runtime import pipeline_call
from finetune_runtime.convention import CallConvention
from tasks.common.families.denoiser import Denoiser
from tasks.common.families.export_profile import ExportProfile
from tasks.common.families.input_images import InputImages
from tasks.common.families.latent_codec import LatentCodec
from tasks.common.families.pipeline_classes import PipelineClasses
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
        self.modules = {**({f.denoiser.name: self.denoiser} if self.denoiser is not None else {}), "vae": self.vae,
                        **dict(zip(f.text.encoder_names, self.text_encoders))}
        if self.denoiser is not None:
            self.denoiser_config = dict(self.denoiser.config)

    def load_denoiser(self, base: Path, dtype: Any = None, quantize: Any = None) -> None:
        """Load the denoiser's weights now (after the prompts are encoded, the text encoders gone);
        `dtype`: straight into that precision (where training keeps the denoiser's weights frozen);
        `quantize` (tasks/common/quantize.BasePrecision): its Linear layers quantized as they load."""
        if self.denoiser is None:
            self.denoiser = self.family.denoiser.load(base, dtype, quantize)
            self.modules = {self.family.denoiser.name: self.denoiser, **self.modules}

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
        self.denoiser = self.modules.get(self.family.denoiser.name)


#: members a family defined before the denoiser role -> where they are now
_MOVED = {"denoiser_name": "denoiser.name", "objective": "denoiser.objective",
          "lora_targets": "denoiser.lora_targets", "guidance_in_batch": "denoiser.guidance_in_batch",
          "default_weighting_scheme": "denoiser.weighting_scheme", "predict": "denoiser.predict",
          "latent_shape": "denoiser.latent_shape", "load_denoiser": "denoiser.load",
          "noise_scheduler": "denoiser.noise_scheduler", "objective_options": "denoiser.objective_options",
          "refused_options": "families.refused_options(family) (the denoiser's, the text's)",
          "lora_components": "denoiser.name and the trained text encoders",
          "takes_references": "inputs.trains", "reference_pixels": "inputs.pixels",
          "trains_embeddings": "text.trains_embeddings",
          "class_images_refusal": "families.class_images_refusal(family) (inputs.least, video)",
          "pipeline_class_names": "pipeline.names", "matches": "pipeline.matches",
          "pipeline_class": "pipeline.diffusers_class", "prepare_base": "pipeline.prepare",
          "xla_tested": "denoiser.xla_tested", "image_tokens": "denoiser.image_tokens",
          "spatial_compression": "denoiser.spatial_compression",
          "temporal_compression": "denoiser.temporal_compression"}


class ModelFamily:
    """One model family. Subclasses set the class attributes and override what differs."""

    #: short name used in reports, tags and params checks ("sd", "sdxl", "sd3", "flux")
    name: ClassVar[str]
    #: a human name for messages
    title: ClassVar[str]
    #: `base.model` value of the built-in tiny model
    builtin: ClassVar[str]
    #: which diffusers pipeline its folders are: the class names it loads, how a folder is recognised
    pipeline: ClassVar[PipelineClasses]
    #: how a prompt becomes conditioning: text encoders and tokenizers, tokenizing, encoding, which train
    text: ClassVar[TextConditioner] = TextConditioner()
    #: how the denoiser is loaded, trained (its objective) and called, where LoRA goes on it
    denoiser: ClassVar[Denoiser] = Denoiser()
    #: how pixels become the denoiser's latents: the VAE's input, the latents' scaling, the pixel multiple
    codec: ClassVar[LatentCodec] = LatentCodec()
    #: the images its pipeline takes beside the prompt, and whether training pairs targets with them
    inputs: ClassVar[InputImages] = InputImages()
    #: a video model: trains on clips (ingest's clips.jsonl, pixels (3, F, H, W)), its pipeline makes clips
    video: ClassVar[bool] = False
    #: how a fine-tune leaves training: OpenVINO pipeline, GenAI and ComfyUI adapter keys, single file
    export: ClassVar[ExportProfile] = ExportProfile(ov_pipeline=None)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """The family's title in its roles' messages; a member that moved into a role is refused, naming
        where it went (a family written before the role would otherwise be read without it)."""
        super().__init_subclass__(**kwargs)
        if moved := sorted(set(vars(cls)) & set(_MOVED)):
            raise TypeError(f"{cls.__name__}: " + "; ".join(f"{k} is now {_MOVED[k]}" for k in moved)
                            + " (tasks/common/families/README.md)")
        for role in ("export", "text", "denoiser", "inputs"):
            if "title" in vars(cls) or role in vars(cls):
                record = getattr(cls, role)
                setattr(cls, role, replace(record, title=getattr(cls, "title", record.title)))

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
        role = cls.denoiser
        scheduler = role.noise_scheduler(base, prediction_type)
        if not denoiser:
            config = getattr(diffusers, index[role.name][1]).load_config(base, subfolder=role.name)
            log.info("loaded %s base model from %s (%s objective; %s later)", cls.title, base, role.objective,
                     role.name)
            return Components(cls, tokenizers, encoders, vae, None, scheduler, denoiser_config=dict(config))
        log.info("loaded %s base model from %s (%s objective)", cls.title, base, role.objective)
        return Components(cls, tokenizers, encoders, vae, role.load(base), scheduler)

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
        return CallConvention(input_images=cls.inputs.most, min_input_images=cls.inputs.least,
                               latent_patch=max(1, cls.codec.pixel_multiple // 8))


def class_images_refusal(family: type[ModelFamily]) -> str | None:
    """Why prior preservation's class images cannot be made with this family (None: they can): a family
    that needs an input image makes none from a prompt alone, and the class_images stage makes images,
    not a video family's clips."""
    if family.inputs.least:
        return f"{family.title} makes no image from a prompt alone, so it cannot make class images"
    if family.video:
        return (f"{family.title} trains on clips and the class_images stage makes images, not clips, so it "
                "cannot make its class images")
    return None


def refused_options(family: type[ModelFamily]) -> dict[str, str]:
    """train.* keys this family refuses when they are set away from their default (key: why): what its
    denoiser's objective and call have no use for, a text encoder that cannot train, the video-only
    options where the family makes images."""
    return {**family.denoiser.refused_options(), **family.text.refused_options(), **_video_option_refusals(family)}


def _video_option_refusals(family: type[ModelFamily]) -> dict[str, str]:
    """The train.* keys only a video family reads (key: why), refused by every other family."""
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
