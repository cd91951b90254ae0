"""Z-Image: a single-stream S3-DiT transformer over 16-channel latents, one Qwen3 text encoder.

Conditioning (as ZImagePipeline.encode_prompt builds it): the prompt goes through Qwen3's chat
template (a user turn, the assistant's opening, thinking on), padded to `max_sequence_length`; the
second-to-last hidden state is the sequence and only its unpadded tokens reach the transformer.
Prompts have different lengths, so the conditioning is `(hidden, mask)`: the hidden states padded
to the fixed length with the padding zeroed, and the attention mask (float, (b, L)) in the slot
other families give a pooled vector; the text cache stores and concatenates both per prompt, and
`predict` cuts each row back to its own tokens.

Latents: FLUX.1's 16-channel VAE (its shift and scaling), unpacked; the transformer takes a list
of (c, 1, h, w) images and a list of caption features, the time as 1 - sigma, and predicts
x_0 - noise, the negative of the flow-matching velocity (the pipeline negates it before the
scheduler's step; `predict` does the same). Classifier-free guidance doubles the batch, with
Z-Image's own rule (pos + scale x (pos - neg), off at scale 0, as the distilled Z-Image-Turbo runs).
No text-encoder training and no textual inversion, as diffusers' train_dreambooth_lora_z_image.py.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from finetune_runtime.convention import CallConvention
from tasks.common.families.denoiser import PredictInputs
from tasks.common.families.flow import FlowDenoiser, FlowMatchingFamily, flow_scheduler
from tasks.common.families.pipeline_classes import PipelineClasses
from tasks.common.families.qwen3_chat import Qwen3Chat, Qwen3ChatText
from tasks.common.families.tiny import qwen3_config, qwen_tokenizer, seeded, tiny_vae


class _Text(Qwen3ChatText):
    """Qwen3 through its chat template (`chat`), the chosen hidden states cut by the mask."""

    def encode_prompt(self, components: Any, input_ids: list[Any], text_encoders: list[Any] | None = None
                      ) -> tuple[Any, Any]:
        """(the second-to-last hidden states with the padding zeroed, the float attention mask)."""
        (qwen,) = text_encoders or components.text_encoders
        (hidden,), mask = self.chat.hidden_states(qwen, input_ids[0], components.tokenizers[0].pad_token_id)
        return hidden * mask.unsqueeze(-1).to(hidden.dtype), mask.float()


class _Denoiser(FlowDenoiser):
    """The S3-DiT over unpadded captions; it predicts x_0 - noise, the negated velocity."""

    def predict(self, denoiser: Any, noisy_latents: Any, timesteps: Any, hidden: Any, pooled: Any,
                inputs: PredictInputs) -> Any:
        """The velocity noise - x_0: the transformer's output negated; `pooled` is the prompts' mask."""
        import torch

        images = list(noisy_latents.unsqueeze(2).unbind(0))  # (c, 1, h, w) each
        captions = [row[keep.bool()] for row, keep in zip(hidden, pooled)]
        out = denoiser(images, (1000 - timesteps) / 1000, captions, return_dict=False)[0]
        return -torch.stack(out).squeeze(2).to(noisy_latents.dtype)


class ZImage(FlowMatchingFamily):
    name = "zimage"
    title = "Z-Image"
    builtin = "builtin:tiny-zimage"
    pipeline = PipelineClasses(("ZImagePipeline",))
    # Qwen3 with thinking on, its second-to-last hidden states, 512 tokens (ZImagePipeline's)
    text = _Text(trainable=(), max_sequence_length=512, chat=Qwen3Chat(thinking=True, layers=(-2,)),
                 frozen_because="its LoRA loader has no Qwen3 part")
    denoiser = _Denoiser()
    export = replace(FlowMatchingFamily.export, ov_pipeline="OVZImagePipeline")

    @classmethod
    def call_convention(cls) -> CallConvention:
        """ZImagePipeline hard-codes 1024 px when given no size: 128 latents over the real VAE's factor 8."""
        return replace(super().call_convention(), default_sample_size=128)

    @classmethod
    def build_tiny(cls, seed: int) -> Any:
        """A 2-layer Qwen3 16 wide, a transformer of one main and one refiner layer 64 wide (4 heads
        of 16), FLUX.1's VAE layout at toy size (16 channels, its shift and scaling)."""
        from diffusers import ZImagePipeline, ZImageTransformer2DModel
        from transformers import Qwen3Model

        tokenizer = qwen_tokenizer(max_length=512)
        transformer = seeded(seed, lambda: ZImageTransformer2DModel(
            all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=64, n_layers=1, n_refiner_layers=1,
            n_heads=4, n_kv_heads=4, cap_feat_dim=16, axes_dims=[4, 6, 6], axes_lens=[1024, 512, 512],
        ))
        vae = seeded(seed + 1, lambda: tiny_vae(64, latent_channels=16, shift_factor=0.1159, scaling_factor=0.3611,
                                                use_quant_conv=False, use_post_quant_conv=False))
        text_encoder = seeded(seed + 2, lambda: Qwen3Model(qwen3_config(len(tokenizer), tokenizer.pad_token_id)))
        return ZImagePipeline(scheduler=flow_scheduler(shift=3.0), vae=vae, text_encoder=text_encoder,
                              tokenizer=tokenizer, transformer=transformer)
