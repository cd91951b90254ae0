"""Stable Diffusion 3 / 3.5: an MMDiT transformer over 16-channel latents, three text encoders.

Conditioning (as StableDiffusion3Pipeline.encode_prompt builds it): the penultimate hidden states of
CLIP-L and CLIP-G side by side, zero-padded to T5's width, then T5's sequence after them; pooled is
both CLIPs' projections side by side. Without T5 (a base saved with text_encoder_3 null) its part is
zeros. Flow matching with the scheduler's shift (3.0 for SD3.5); the transformer takes the
scheduler's timesteps (0-1000).
"""
from __future__ import annotations

from typing import Any

from tasks.common.families.denoiser import PredictInputs
from tasks.common.families.export_profile import ExportProfile
from tasks.common.families.flow import FlowDenoiser, FlowMatchingFamily, flow_scheduler
from tasks.common.families.pipeline_classes import PipelineClasses
from tasks.common.families.text_conditioner import T5Text
from tasks.common.families.tiny import clip_text_config, clip_tokenizer, seeded, t5_config, t5_tokenizer, tiny_vae

#: CLIP-L and CLIP-G in the ComfyUI file, as SDXL's
_CLIP_COMFYUI = {"text_encoder": "lora_te1_", "text_encoder_2": "lora_te2_"}


class _Text(T5Text):
    """CLIP-L and CLIP-G side by side, zero-padded to T5's width, T5's sequence after them; both pooled."""

    def encode_prompt(self, components: Any, input_ids: list[Any], text_encoders: list[Any] | None = None
                      ) -> tuple[Any, Any]:
        import torch
        import torch.nn.functional as F

        encoders = text_encoders or components.text_encoders
        hidden, pooled = [], []
        for encoder, ids in zip(encoders[:2], input_ids[:2]):
            out = encoder(ids.to(next(encoder.parameters()).device), output_hidden_states=True, return_dict=True)
            hidden.append(out.hidden_states[-2])
            pooled.append(out.text_embeds)
        clip = torch.cat(hidden, dim=-1)
        t5_width = components.denoiser_config["joint_attention_dim"]
        if len(encoders) > 2:
            t5 = encoders[2](input_ids[2].to(next(encoders[2].parameters()).device), return_dict=True)[0]
        else:  # no T5 in this base: zeros, as the pipeline does
            t5 = torch.zeros(clip.shape[0], input_ids[0].shape[1], t5_width, device=clip.device, dtype=clip.dtype)
        clip = F.pad(clip, (0, t5_width - clip.shape[-1]))
        return torch.cat([clip, t5.to(clip.dtype)], dim=-2), torch.cat(pooled, dim=-1)


class _Pipeline(PipelineClasses):
    """Every SD3 pipeline variant (img2img, inpaint) by its class name's prefix."""

    def matches(self, index: dict[str, Any]) -> bool:
        return index.get("_class_name", "").startswith("StableDiffusion3")


class _Denoiser(FlowDenoiser):
    """The MMDiT over the latents, the text's sequence and pooled vector; no guidance input."""

    def predict(self, denoiser: Any, noisy_latents: Any, timesteps: Any, hidden: Any, pooled: Any,
                inputs: PredictInputs) -> Any:
        return denoiser(hidden_states=noisy_latents, timestep=timesteps, encoder_hidden_states=hidden,
                        pooled_projections=pooled, return_dict=False)[0]


class StableDiffusion3(FlowMatchingFamily):
    name = "sd3"
    title = "Stable Diffusion 3/3.5"
    builtin = "builtin:tiny-sd3"
    pipeline = _Pipeline(("StableDiffusion3Pipeline",))
    # CLIP-L and CLIP-G train with train_text_encoder, T5 never (as in diffusers' scripts)
    text = _Text(encoder_names=("text_encoder", "text_encoder_2", "text_encoder_3"),
                 tokenizer_names=("tokenizer", "tokenizer_2", "tokenizer_3"), t5_tokenizer="tokenizer_3",
                 trainable=("text_encoder", "text_encoder_2"), max_sequence_length=77)
    denoiser = _Denoiser(takes_guidance_scale=False,
                         weighting_scheme="logit_normal")  # train_dreambooth_lora_sd3.py's default
    # GenAI 2026.4.1 applies an SD3 LoRA to the transformer under this prefix; no prefix tried
    # (lora_te1/2, lora_te, te1/2, clip_l/g) reached the CLIP encoders, so those layers are refused.
    # ComfyUI maps OneTrainer's kohya-style names for SD3 (comfy/lora.py), CLIP-L/G as SDXL's
    export = ExportProfile(ov_pipeline="OVStableDiffusion3Pipeline", genai_lora_prefixes={"transformer": "transformer"},
                           comfyui_lora_prefixes={"transformer": "lora_transformer_", **_CLIP_COMFYUI},
                           comfyui_lycoris_prefixes={"transformer": "lycoris_", **_CLIP_COMFYUI})

    @classmethod
    def build_tiny(cls, seed: int) -> Any:
        """CLIP-L and CLIP-G (32 wide, with projections), a 2-layer T5 (64 wide), a 2-layer MMDiT."""
        from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline
        from transformers import CLIPTextModelWithProjection, T5EncoderModel

        tokenizer, vocab_size = clip_tokenizer()
        tokenizer_2, _ = clip_tokenizer()
        tokenizer_3 = t5_tokenizer(max_length=256)  # StableDiffusion3Pipeline's max_sequence_length
        transformer = seeded(seed, lambda: SD3Transformer2DModel(
            sample_size=32, patch_size=1, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=8,
            num_attention_heads=4, joint_attention_dim=64, caption_projection_dim=32, pooled_projection_dim=64,
            pos_embed_max_size=64,
        ))
        vae = seeded(seed + 1, lambda: tiny_vae(64, latent_channels=16, shift_factor=0.0609, scaling_factor=1.5035,
                                                use_quant_conv=False, use_post_quant_conv=False))
        text_encoder = seeded(seed + 2, lambda: CLIPTextModelWithProjection(
            clip_text_config(vocab_size, projection_dim=32)))
        text_encoder_2 = seeded(seed + 3, lambda: CLIPTextModelWithProjection(
            clip_text_config(vocab_size, projection_dim=32)))
        text_encoder_3 = seeded(seed + 4, lambda: T5EncoderModel(t5_config(len(tokenizer_3), d_model=64)))
        return StableDiffusion3Pipeline(
            transformer=transformer, scheduler=flow_scheduler(shift=3.0), vae=vae,
            text_encoder=text_encoder, tokenizer=tokenizer, text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2,
            text_encoder_3=text_encoder_3, tokenizer_3=tokenizer_3,
        )
