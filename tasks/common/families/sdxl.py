"""Stable Diffusion XL: two CLIP text encoders, a UNet with size/crop micro-conditioning.

Conditioning concatenates the penultimate hidden states of both encoders; the second one's pooled
projection and the "time ids" (original size, crop top-left, target size) go to the UNet as
`added_cond_kwargs`. Textual-inversion embeddings are keyed `clip_l`/`clip_g`, the layout SDXL
embeddings are shared in.
"""
from __future__ import annotations

from typing import Any

from tasks.common.errors import UserError
from tasks.common.families.base import Components, ModelFamily
from tasks.common.families.denoiser import Denoiser, PredictInputs
from tasks.common.families.export_profile import ExportProfile
from tasks.common.families.pipeline_classes import PipelineClasses
from tasks.common.families.text_conditioner import TextConditioner
from tasks.common.families.tiny import clip_text_config, clip_tokenizer, ddpm_kwargs, seeded, tiny_vae

REFINER = ("an SDXL refiner (one OpenCLIP text encoder) has no supported original single-file layout here; "
           "set export.single_file: none")


class _Export(ExportProfile):
    """SDXL's base has the original single-file layout; a refiner (one text encoder) has none here."""

    def single_file_refusal(self, index: dict[str, Any]) -> str | None:
        return REFINER if (index.get("text_encoder") or [None])[0] is None else None

    def single_file_layout(self, pipe: Any) -> str:
        if getattr(pipe, "text_encoder", None) is None:
            raise UserError("export.single_file: " + REFINER)
        return "sdxl"


class _Pipeline(PipelineClasses):
    """Every SDXL pipeline variant (img2img, inpaint) by its class name's prefix."""

    def matches(self, index: dict[str, Any]) -> bool:
        return index.get("_class_name", "").startswith("StableDiffusionXL")


class _Text(TextConditioner):
    """Two CLIP encoders: their penultimate hidden states side by side, the second's pooled projection."""

    def encode_prompt(self, components: Components, input_ids: list[Any], text_encoders: list[Any] | None = None
                      ) -> tuple[Any, Any]:
        import torch

        hidden, pooled = [], None
        for encoder, ids in zip(text_encoders or components.text_encoders, input_ids):
            out = encoder(ids.to(next(encoder.parameters()).device), output_hidden_states=True, return_dict=True)
            hidden.append(out.hidden_states[-2])
            pooled = getattr(out, "text_embeds", None)  # the last encoder (with projection) gives it
        return torch.cat(hidden, dim=-1), pooled


class _Denoiser(Denoiser):
    """A UNet that also takes the pooled text and each row's size and crop ("time ids")."""

    def predict(self, denoiser: Any, noisy_latents: Any, timesteps: Any, hidden: Any, pooled: Any,
                inputs: PredictInputs) -> Any:
        if pooled is None:
            raise RuntimeError("SDXL conditioning needs the pooled embeds of text_encoder_2")
        g = inputs.geometry
        time_ids = add_time_ids(g.original_sizes, g.crops_top_left, inputs.resolution, g.target_sizes)
        added = {"text_embeds": pooled, "time_ids": time_ids.to(hidden.device, hidden.dtype)}
        return denoiser(noisy_latents, timesteps, encoder_hidden_states=hidden, added_cond_kwargs=added,
                        return_dict=False)[0]


class StableDiffusionXL(ModelFamily):
    name = "sdxl"
    title = "Stable Diffusion XL"
    builtin = "builtin:tiny-sdxl"
    pipeline = _Pipeline(("StableDiffusionXLPipeline",))
    text = _Text(encoder_names=("text_encoder", "text_encoder_2"), tokenizer_names=("tokenizer", "tokenizer_2"),
                 embedding_keys=("clip_l", "clip_g"))
    denoiser = _Denoiser()
    export = _Export(ov_pipeline="OVStableDiffusionXLPipeline",
                     genai_lora_prefixes={"unet": "lora_unet", "text_encoder": "lora_te1",
                                          "text_encoder_2": "lora_te2"},
                     comfyui_lora_prefixes={"unet": "lora_unet_", "text_encoder": "lora_te1_",
                                            "text_encoder_2": "lora_te2_"})

    @classmethod
    def build_tiny(cls, seed: int, text_2_width: int = 32) -> Any:
        """Two text encoders (the second with projection), size/crop conditioning.

        `text_2_width`: the second encoder's width (SDXL's are 768 and 1280; here both 32 unless set).
        """
        from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
        from transformers import CLIPTextModel, CLIPTextModelWithProjection

        tokenizer, vocab_size = clip_tokenizer()
        tokenizer_2, _ = clip_tokenizer()
        unet = seeded(seed, lambda: UNet2DConditionModel(
            block_out_channels=(32, 64), layers_per_block=2, sample_size=32, in_channels=4, out_channels=4,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), attention_head_dim=(2, 4),
            use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=8,
            transformer_layers_per_block=(1, 2),
            projection_class_embeddings_input_dim=6 * 8 + 32,  # 6 size/crop ids x 8 + pooled text (32)
            cross_attention_dim=32 + text_2_width,  # both encoders' hidden states, concatenated
            norm_num_groups=1,
        ))
        vae = seeded(seed + 1, lambda: tiny_vae(128))
        text_encoder = seeded(seed + 2, lambda: CLIPTextModel(clip_text_config(vocab_size)))
        text_encoder_2 = seeded(seed + 3, lambda: CLIPTextModelWithProjection(
            clip_text_config(vocab_size, projection_dim=32, hidden_size=text_2_width)))
        return StableDiffusionXLPipeline(
            vae=vae, text_encoder=text_encoder, text_encoder_2=text_encoder_2, tokenizer=tokenizer,
            tokenizer_2=tokenizer_2, unet=unet,
            scheduler=EulerDiscreteScheduler(**ddpm_kwargs(), timestep_spacing="leading"),
            force_zeros_for_empty_prompt=True,
        )


def add_time_ids(original_sizes: Any, crops_top_left: Any, resolution: int, target_sizes: Any = None) -> Any:
    """SDXL micro-conditioning, one row per image: (orig_h, orig_w, crop_top, crop_left, h, w).

    `target_sizes` (rows of (h, w): the images' buckets); None: every image is resolution^2.
    """
    import torch

    if target_sizes is None:
        target = torch.tensor([resolution, resolution], dtype=original_sizes.dtype, device=original_sizes.device)
        target_sizes = target.expand_as(original_sizes)
    return torch.cat([original_sizes, crops_top_left, target_sizes.to(original_sizes)], dim=1)
