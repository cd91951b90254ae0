"""Sana: a linear-attention DiT (SanaTransformer2DModel) over the deep-compression autoencoder's
latents (AutoencoderDC, 32x in the released models), one Gemma-2 text encoder.

Conditioning (as SanaPipeline.encode_prompt builds it, the way diffusers' train_dreambooth_lora_sana.py
calls it): the prompt lowercased and stripped, a `<bos>` first, padded on the right to
`max_sequence_length` (default 300); Gemma-2's last hidden state is the sequence. The pipeline keeps
the first token and the last max_sequence_length - 1 (`select_index`), which without the "complex
human instruction" is every token. Variable-length prompts, the convention of the masked families:
`encode_prompt` returns `(hidden, mask)`, `hidden` padded to the fixed length (train.max_sequence_length
or 300) so that every prompt of the text cache has the same length, and the attention mask as a float
(b, L) tensor in the slot where other families put a pooled vector (the text cache stores and
concatenates it like one); `predict` passes it as the transformer's `encoder_attention_mask`.

The complex human instruction (a long preamble the pipeline's `__call__` puts before each prompt by
default): diffusers' script encodes prompts without it (`--complex_human_instruction` defaults to
None) and validates without it too, so training does here, and every generation (validation, class
images, export, evaluation, the served model) passes `complex_human_instruction=None` through the call
convention: training and generation see the same conditioning. (None, as the script passes it:
optimum-intel's OV pipelines fail on an empty list argument.)

Latents: the autoencoder's latent (deterministic, no posterior to sample) times the VAE config's
scaling_factor; no packing. Flow matching on the base's scheduler config read as a
FlowMatchEulerDiscreteScheduler (as diffusers' script; the pipeline ships a DPMSolverMultistepScheduler
with flow prediction), timesteps on the 0-1000 scale times the transformer's `timestep_scale` (1 in
the released models), the prediction the velocity noise - x0 as is. LoRA on the attention's q/k/v (the
script's default targets); no text-encoder training (the pipeline's LoRA loader has a transformer
part only).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from finetune_runtime.convention import CallConvention
from tasks.common.families.denoiser import PredictInputs
from tasks.common.families.export_profile import ExportProfile
from tasks.common.families.flow import FlowDenoiser, FlowMatchingFamily
from tasks.common.families.latent_codec import LatentCodec
from tasks.common.families.pipeline_classes import PipelineClasses
from tasks.common.families.text_conditioner import TextConditioner
from tasks.common.families.tiny import gemma2_config, gemma_tokenizer, seeded


class _Text(TextConditioner):
    """Gemma-2's last hidden state, padded to a fixed length, its mask in the pooled slot."""

    def tokenize(self, components: Any, prompts: list[str], max_sequence_length: int | None = None) -> list[Any]:
        """Lowercased, stripped prompts (the pipeline's preprocessing without clean_caption), padded on
        the right to `max_sequence_length`."""
        length = max_sequence_length or self.max_sequence_length
        texts = [p.lower().strip() for p in prompts]
        return [components.tokenizers[0](texts, padding="max_length", max_length=length, truncation=True,
                                         add_special_tokens=True, padding_side="right", return_tensors="pt").input_ids]

    def encode_prompt(self, components: Any, input_ids: list[Any], text_encoders: list[Any] | None = None
                      ) -> tuple[Any, Any]:
        """(Gemma-2's last hidden state, the float attention mask)."""
        (gemma,) = text_encoders or components.text_encoders
        ids = input_ids[0].to(next(gemma.parameters()).device)
        mask = (ids != components.tokenizers[0].pad_token_id).long()  # right padding: the pads are the tail
        hidden = gemma(input_ids=ids, attention_mask=mask)[0]
        return hidden, mask.float()


class _Denoiser(FlowDenoiser):
    """The linear-attention DiT: the text mask as its attention mask, its own timestep scale."""

    def predict(self, denoiser: Any, noisy_latents: Any, timesteps: Any, hidden: Any, pooled: Any,
                inputs: PredictInputs) -> Any:
        config = getattr(denoiser, "module", denoiser).config  # (DDP wraps it in .module)
        pred = denoiser(noisy_latents, encoder_hidden_states=hidden, encoder_attention_mask=pooled,
                        timestep=timesteps * config.timestep_scale, return_dict=False)[0]
        if config.out_channels // 2 == noisy_latents.shape[1]:  # a learned sigma, as the pipeline drops it
            pred = pred.chunk(2, dim=1)[0]
        return pred


class Sana(FlowMatchingFamily):
    name = "sana"
    title = "Sana"
    builtin = "builtin:tiny-sana"
    pipeline = PipelineClasses(("SanaPipeline",))
    text = _Text(trainable=(), max_sequence_length=300,  # SanaPipeline's and the script's length
                 frozen_because="its LoRA loader has no Gemma part", trains_embeddings=False)
    # train_dreambooth_lora_sana.py's LoRA targets and weighting scheme ("none")
    denoiser = _Denoiser(lora_targets=("to_k", "to_q", "to_v"), takes_guidance_scale=False)
    #: image sides: multiples of the released autoencoder's 32x compression (the tiny one's 4x divides it);
    #: everything at run time reads the loaded VAE's factor (`pipe.vae_scale_factor`)
    codec = LatentCodec(pixel_multiple=32)
    #: ComfyUI has no Sana model: no key of a ComfyUI adapter file would load (`lora_format: comfyui` is refused)
    export = ExportProfile(ov_pipeline="OVSanaPipeline", comfyui_lora_prefixes=None)

    @classmethod
    def call_convention(cls) -> CallConvention:
        """No complex human instruction, as training encodes prompts (and as the script validates)."""
        return replace(super().call_convention(), arguments={"complex_human_instruction": None},
                       latent_patch=1)  # its 32 px multiple is the autoencoder's factor, patches of 1

    @classmethod
    def build_tiny(cls, seed: int) -> Any:
        """A 2-layer Gemma-2 16 wide, a 2-block transformer 16 wide (sample_size 16: SanaPipeline's
        resolution binning knows 16, 32, 64, 128), a 3-stage autoencoder (4x, 4 latent channels,
        EfficientViT attention in its last stage) with the released one's scaling factor."""
        from diffusers import AutoencoderDC, DPMSolverMultistepScheduler, SanaPipeline, SanaTransformer2DModel
        from transformers import Gemma2Model

        tokenizer = gemma_tokenizer(max_length=cls.text.max_sequence_length)
        transformer = seeded(seed, lambda: SanaTransformer2DModel(
            patch_size=1, in_channels=4, out_channels=4, num_layers=2, num_attention_heads=2, attention_head_dim=8,
            num_cross_attention_heads=2, cross_attention_head_dim=8, cross_attention_dim=16, caption_channels=16,
            sample_size=16,
        ))
        stages = dict(block_types=("ResBlock", "ResBlock", "EfficientViTBlock"), block_out_channels=(8, 8, 16),
                      qkv_multiscales=((), (), (5,)))
        vae = seeded(seed + 1, lambda: AutoencoderDC(
            in_channels=3, latent_channels=4, attention_head_dim=2, encoder_layers_per_block=(1, 1, 1),
            decoder_layers_per_block=(1, 1, 1), downsample_block_type="conv", upsample_block_type="interpolate",
            decoder_norm_types="rms_norm", decoder_act_fns="silu", scaling_factor=0.41407,
            **{f"{part}_{key}": value for part in ("encoder", "decoder") for key, value in stages.items()},
        ))
        text_encoder = seeded(seed + 2, lambda: Gemma2Model(gemma2_config(len(tokenizer))))
        # the released models' scheduler: DPM-Solver++ with flow sigmas (shift 3, Sana 1024px's)
        scheduler = DPMSolverMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
        return SanaPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                            scheduler=scheduler)
