"""The base model's parts for training, SD 1.x/2.x and SDXL behind one interface.

What differs between the families is only how a prompt becomes UNet conditioning: SD uses the
last hidden state of one CLIP text encoder; SDXL concatenates the penultimate hidden states of
two encoders and adds the second one's pooled projection plus the size/crop "time ids"
(original size, crop top-left, target size) as `added_cond_kwargs`.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from tasks.common.errors import UserError

log = logging.getLogger(__name__)

Family = Literal["sd", "sdxl"]


def detect_family(base: Path) -> Family:
    """'sdxl' when the pipeline has a second text encoder, else 'sd'."""
    index_path = Path(base) / "model_index.json"
    if not index_path.is_file():
        raise UserError(f"{base} is not a diffusers pipeline folder (no model_index.json): run the `base` stage first")
    index = json.loads(index_path.read_text())
    return "sdxl" if "text_encoder_2" in index or "XL" in index.get("_class_name", "") else "sd"


@dataclass
class Components:
    """Tokenizers, text encoders, VAE, UNet and the training noise scheduler of one base model."""

    family: Family
    tokenizers: list[Any]
    text_encoders: list[torch.nn.Module]
    vae: torch.nn.Module
    unet: torch.nn.Module
    noise_scheduler: Any
    modules: dict[str, torch.nn.Module] = field(default_factory=dict)

    def __post_init__(self) -> None:
        names = ["text_encoder", "text_encoder_2"][: len(self.text_encoders)]
        self.modules = {"unet": self.unet, "vae": self.vae, **dict(zip(names, self.text_encoders))}

    def text_encoder_names(self) -> list[str]:
        return [n for n in self.modules if n.startswith("text_encoder")]


def load_components(base: Path, prediction_type: str | None = None) -> Components:
    """Load every part from a diffusers folder; the noise scheduler is DDPM with the base's betas."""
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    base = Path(base)
    family = detect_family(base)
    noise_scheduler = DDPMScheduler.from_pretrained(base, subfolder="scheduler")
    if prediction_type is not None:
        noise_scheduler.register_to_config(prediction_type=prediction_type)
    tokenizers = [CLIPTokenizer.from_pretrained(base, subfolder="tokenizer")]
    text_encoders: list[torch.nn.Module] = [CLIPTextModel.from_pretrained(base, subfolder="text_encoder")]
    if family == "sdxl":
        tokenizers.append(CLIPTokenizer.from_pretrained(base, subfolder="tokenizer_2"))
        text_encoders.append(CLIPTextModelWithProjection.from_pretrained(base, subfolder="text_encoder_2"))
    vae = AutoencoderKL.from_pretrained(base, subfolder="vae")
    unet = UNet2DConditionModel.from_pretrained(base, subfolder="unet")
    log.info("loaded %s base model from %s (prediction type %s)", family, base,
             noise_scheduler.config.prediction_type)
    return Components(family, tokenizers, text_encoders, vae, unet, noise_scheduler)


def tokenize(components: Components, prompts: list[str]) -> list[torch.Tensor]:
    """Token ids per tokenizer, padded/truncated to each tokenizer's max length."""
    return [
        tok(prompts, padding="max_length", max_length=tok.model_max_length, truncation=True,
            return_tensors="pt").input_ids
        for tok in components.tokenizers
    ]


def encode_prompt(
    components: Components,
    input_ids: list[torch.Tensor],
    text_encoders: list[torch.nn.Module] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(encoder_hidden_states, pooled text embeds or None). `text_encoders` may be wrapped copies."""
    encoders = text_encoders or components.text_encoders
    if components.family == "sd":
        device = next(encoders[0].parameters()).device
        return encoders[0](input_ids[0].to(device), return_dict=True).last_hidden_state, None
    hidden, pooled = [], None
    for encoder, ids in zip(encoders, input_ids):
        out = encoder(ids.to(next(encoder.parameters()).device), output_hidden_states=True, return_dict=True)
        hidden.append(out.hidden_states[-2])
        pooled = getattr(out, "text_embeds", None)  # the last encoder (with projection) gives it
    return torch.cat(hidden, dim=-1), pooled


def add_time_ids(original_sizes: torch.Tensor, crops_top_left: torch.Tensor, resolution: int) -> torch.Tensor:
    """SDXL micro-conditioning, one row per image: (orig_h, orig_w, crop_top, crop_left, h, w)."""
    target = torch.tensor([resolution, resolution], dtype=original_sizes.dtype, device=original_sizes.device)
    target = target.expand_as(original_sizes)
    return torch.cat([original_sizes, crops_top_left, target], dim=1)


def unet_conditioning(
    components: Components,
    hidden: torch.Tensor,
    pooled: torch.Tensor | None,
    original_sizes: torch.Tensor,
    crops_top_left: torch.Tensor,
    resolution: int,
) -> dict[str, Any]:
    """Keyword arguments for the UNet call besides the noisy latents and timesteps."""
    kwargs: dict[str, Any] = {"encoder_hidden_states": hidden}
    if components.family == "sdxl":
        if pooled is None:
            raise RuntimeError("SDXL conditioning needs the pooled embeds of text_encoder_2")
        time_ids = add_time_ids(original_sizes, crops_top_left, resolution).to(hidden.device, hidden.dtype)
        kwargs["added_cond_kwargs"] = {"text_embeds": pooled, "time_ids": time_ids}
    return kwargs


def pipeline_from_modules(
    base: Path, components: Components, modules: dict[str, torch.nn.Module], keep_safety_checker: bool = False
) -> Any:
    """A diffusers pipeline over live (possibly training) modules: the base supplies the rest.

    Used for validation images during training and for saving: nothing is loaded twice, and the
    tokenizers are the (possibly extended) ones being trained with.
    """
    from diffusers import DiffusionPipeline

    parts: dict[str, Any] = dict(modules)
    parts["tokenizer"] = components.tokenizers[0]
    if components.family == "sdxl":
        parts["tokenizer_2"] = components.tokenizers[1]
    elif not keep_safety_checker:
        # An SD 1.x base may carry a safety checker; validation images do not need it.
        parts.update(safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    return DiffusionPipeline.from_pretrained(base, **parts)


def pipeline_class(base: Path) -> type:
    """The diffusers pipeline class a base folder was saved from (model_index.json `_class_name`)."""
    import diffusers

    name = json.loads((Path(base) / "model_index.json").read_text())["_class_name"]
    return getattr(diffusers, name)
