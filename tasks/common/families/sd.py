"""Stable Diffusion 1.x / 2.x: one CLIP text encoder, a UNet, DDPM noise or v prediction.

Conditioning is the text encoder's last hidden state; nothing pooled. SD 2.x (OpenCLIP ViT-H,
cross-attention width 1024) differs only in its single-file layout and, for the 768 px models,
v prediction, which the scheduler config carries.
"""
from __future__ import annotations

from typing import Any

from tasks.common.families.base import Components, ModelFamily
from tasks.common.families.denoiser import Denoiser, PredictInputs
from tasks.common.families.export_profile import ExportProfile
from tasks.common.families.pipeline_classes import PipelineClasses
from tasks.common.families.text_conditioner import TextConditioner
from tasks.common.families.tiny import clip_text_config, clip_tokenizer, ddpm_kwargs, seeded, tiny_vae


class _Export(ExportProfile):
    """SD 1.x and 2.x have an original single-file layout each (told apart by the text width)."""

    def single_file_refusal(self, index: dict[str, Any]) -> str | None:
        return None

    def single_file_layout(self, pipe: Any) -> str:
        return "sd2" if pipe.unet.config["cross_attention_dim"] == 1024 else "sd1"


class _Pipeline(PipelineClasses):
    """Any SD 1.x/2.x pipeline variant saved under another class name (img2img, inpaint) too, as long
    as it has a single text encoder."""

    def matches(self, index: dict[str, Any]) -> bool:
        name = index.get("_class_name", "")
        return name.startswith("StableDiffusion") and "XL" not in name and "3" not in name \
            and (index.get("text_encoder_2") or [None])[0] is None


class _Text(TextConditioner):
    """One CLIP encoder: its last hidden state, nothing pooled."""

    def encode_prompt(self, components: Components, input_ids: list[Any], text_encoders: list[Any] | None = None
                      ) -> tuple[Any, Any]:
        encoder = (text_encoders or components.text_encoders)[0]
        device = next(encoder.parameters()).device
        return encoder(input_ids[0].to(device), return_dict=True).last_hidden_state, None


class _Denoiser(Denoiser):
    """A UNet conditioned on the text's sequence alone."""

    def predict(self, denoiser: Any, noisy_latents: Any, timesteps: Any, hidden: Any, pooled: Any,
                inputs: PredictInputs) -> Any:
        return denoiser(noisy_latents, timesteps, encoder_hidden_states=hidden, return_dict=False)[0]


class StableDiffusion(ModelFamily):
    name = "sd"
    title = "Stable Diffusion 1.x/2.x"
    builtin = "builtin:tiny-sd"
    pipeline = _Pipeline(("StableDiffusionPipeline",))
    text = _Text()
    denoiser = _Denoiser()
    export = _Export(ov_pipeline="OVStableDiffusionPipeline",
                     genai_lora_prefixes={"unet": "lora_unet", "text_encoder": "lora_te"})

    @classmethod
    def build_tiny(cls, seed: int) -> Any:
        """One 2-layer CLIP text encoder, a 32/64-channel UNet with 32-wide cross-attention."""
        from diffusers import DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
        from transformers import CLIPTextModel

        tokenizer, vocab_size = clip_tokenizer()
        unet = seeded(seed, lambda: UNet2DConditionModel(
            block_out_channels=(32, 64), layers_per_block=2, sample_size=32, in_channels=4, out_channels=4,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=32, attention_head_dim=8,
        ))
        vae = seeded(seed + 1, lambda: tiny_vae(64))
        text_encoder = seeded(seed + 2, lambda: CLIPTextModel(clip_text_config(vocab_size)))
        return StableDiffusionPipeline(
            vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
            scheduler=DDIMScheduler(**ddpm_kwargs(), clip_sample=False, set_alpha_to_one=False),
            safety_checker=None, feature_extractor=None, requires_safety_checker=False,
        )

