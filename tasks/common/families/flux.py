"""FLUX.1: a double/single-stream transformer over packed 16-channel latents, CLIP-L + T5.

Conditioning (as FluxPipeline.encode_prompt builds it): T5's last hidden state is the sequence,
CLIP's pooled output the vector, text ids are zeros. Latents are packed 2x2 into 64-channel
tokens with (0, row, column) image ids; guidance-distilled models (FLUX.1-dev) take the guidance
scale as an input (train.guidance_scale), and the transformer takes timesteps / 1000.
"""
from __future__ import annotations

from typing import Any

from tasks.common.families.denoiser import PredictInputs
from tasks.common.families.export_profile import ExportProfile
from tasks.common.families.flow import FlowDenoiser, FlowMatchingFamily, flow_scheduler
from tasks.common.families.pipeline_classes import PipelineClasses
from tasks.common.families.text_conditioner import T5Text
from tasks.common.families.tiny import clip_text_config, clip_tokenizer, seeded, t5_config, t5_tokenizer, tiny_vae


class _Text(T5Text):
    """T5's last hidden state as the sequence, CLIP's pooled output as the vector."""

    def encode_prompt(self, components: Any, input_ids: list[Any], text_encoders: list[Any] | None = None
                      ) -> tuple[Any, Any]:
        clip, t5 = text_encoders or components.text_encoders
        pooled = clip(input_ids[0].to(next(clip.parameters()).device), return_dict=True).pooler_output
        hidden = t5(input_ids[1].to(next(t5.parameters()).device), return_dict=True)[0]
        return hidden, pooled


class FluxDenoiser(FlowDenoiser):
    """The transformer over 2x2-packed latent tokens; distilled guidance as an input, timesteps / 1000."""

    def image_tokens(self, latents: Any, inputs: PredictInputs) -> tuple[Any, Any]:
        """(the noisy latents packed 2x2 into tokens, their (0, row, column) position ids)."""
        from diffusers import FluxPipeline

        b, c, h, w = latents.shape
        packed = FluxPipeline._pack_latents(latents, b, c, h, w)
        return packed, FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, packed.device, packed.dtype)

    def predict(self, denoiser: Any, noisy_latents: Any, timesteps: Any, hidden: Any, pooled: Any,
                inputs: PredictInputs) -> Any:
        """The transformer over `image_tokens`; the prediction read from the noisy latents' tokens."""
        import torch
        from diffusers import FluxPipeline

        b, c, h, w = noisy_latents.shape
        packed, img_ids = self.image_tokens(noisy_latents, inputs)
        txt_ids = torch.zeros(hidden.shape[1], 3, device=packed.device, dtype=packed.dtype)
        guidance = None
        if getattr(denoiser, "module", denoiser).config.guidance_embeds:  # (DDP wraps it in .module)
            guidance = torch.full((b,), float(inputs.guidance_scale), device=packed.device)
        pred = denoiser(hidden_states=packed, timestep=timesteps / 1000, guidance=guidance,
                        pooled_projections=pooled, encoder_hidden_states=hidden, txt_ids=txt_ids, img_ids=img_ids,
                        return_dict=False)[0]
        pred = pred[:, : (h // 2) * (w // 2)]
        return FluxPipeline._unpack_latents(pred, h, w, 1)  # (h, w) are latent sizes: scale factor 1

    def latent_shape(self, pipe: Any, height: int, width: int) -> tuple[int, ...]:
        """Packed: (h/2 x w/2 latent tokens, 4 x channels); FluxPipeline takes `latents` packed."""
        channels = int(pipe.transformer.config["in_channels"])  # already 4 x the VAE's channels
        vsf = int(pipe.vae_scale_factor)
        return ((height // vsf // 2) * (width // vsf // 2), channels)


class Flux(FlowMatchingFamily):
    name = "flux"
    title = "FLUX.1"
    builtin = "builtin:tiny-flux"
    pipeline = PipelineClasses(("FluxPipeline",))
    text = _Text(encoder_names=("text_encoder", "text_encoder_2"), tokenizer_names=("tokenizer", "tokenizer_2"),
                 t5_tokenizer="tokenizer_2", trainable=("text_encoder",), max_sequence_length=512)
    # ComfyUI maps OneTrainer's kohya-style names for FLUX.1 (comfy/lora.py) and diffusers converts them
    # back (its "mixture" kohya layout); CLIP-L as lora_te1_
    export = ExportProfile(ov_pipeline="OVFluxPipeline",
                           comfyui_lora_prefixes={"transformer": "lora_transformer_", "text_encoder": "lora_te1_"},
                           comfyui_lycoris_prefixes={"transformer": "lycoris_", "text_encoder": "lora_te1_"})
    # guidance is an input of the distilled transformer, not a doubled batch; weighting_scheme "none" is
    # train_dreambooth_lora_flux.py's default
    denoiser = FluxDenoiser(guidance_in_batch=False)

    @classmethod
    def build_tiny(cls, seed: int) -> Any:
        """CLIP-L (32 wide), a 2-layer T5 (32 wide), one double- and one single-stream block, guidance input."""
        from diffusers import FluxPipeline, FluxTransformer2DModel
        from transformers import CLIPTextModel, T5EncoderModel

        tokenizer, vocab_size = clip_tokenizer()
        tokenizer_2 = t5_tokenizer(max_length=512)  # FluxPipeline's max_sequence_length
        transformer = seeded(seed, lambda: FluxTransformer2DModel(
            patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
            axes_dims_rope=(4, 6, 6),
        ))
        vae = seeded(seed + 1, lambda: tiny_vae(64, latent_channels=16, shift_factor=0.1159, scaling_factor=0.3611,
                                                use_quant_conv=False, use_post_quant_conv=False))
        text_encoder = seeded(seed + 2, lambda: CLIPTextModel(clip_text_config(vocab_size)))
        text_encoder_2 = seeded(seed + 3, lambda: T5EncoderModel(t5_config(len(tokenizer_2), d_model=32)))
        return FluxPipeline(
            scheduler=flow_scheduler(shift=3.0, dynamic=True), vae=vae, text_encoder=text_encoder,
            tokenizer=tokenizer, text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, transformer=transformer,
        )
