"""Qwen-Image: a double-stream MMDiT over 2x2-packed latents of a 3D (video) VAE, one Qwen2.5-VL text
encoder (its text path only).

Conditioning (as QwenImagePipeline._get_qwen_prompt_embeds builds it): the prompt goes into the
pipeline's fixed template (a system turn describing the image, the user turn, the assistant's
opening), the last hidden state is taken and its first `drop` (34) tokens, the system turn, are
dropped. The pipeline cuts each prompt to its own length and pads to the longest of the call; here
`encode_prompt` returns `(hidden, mask)`: `hidden` padded with zeros to a fixed length
(train.max_sequence_length or the conditioner's `max_sequence_length`, so the text cache can concatenate rows)
and the text attention mask as a float (b, L) tensor in the slot other families give a pooled
vector (the text cache stores it as one); `predict` reads that slot as the transformer's
`encoder_hidden_states_mask` (masked padding is not attended to, and the text's rotary positions
start at 0 either way, so this equals the pipeline's unpadded call).
Latents: the VAE takes pixels as one frame, (b, c, 1, h, w) (`vae_input`), and its sample is
normalised with the config's `latents_mean` / `latents_std` (`scale_latents`), not a scaling
factor; the transformer sees them packed into 2x2 tokens, takes `img_shapes` and timesteps / 1000,
and predicts the flow velocity noise - x0 (no sign change). No text-encoder training, as diffusers'
train_dreambooth_lora_qwen_image.py: the pipeline's LoRA loader has no text-encoder part.
Guidance is true classifier-free guidance, `true_cfg_scale`, which the pipeline runs only with a
negative prompt: a call with a guidance value above 1 and no negative prompt sends " ", as
Qwen-Image's own examples do (`call_convention`), so that a stage's guidance value guides here as in
every other family.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from finetune_runtime.convention import CallConvention
from tasks.common.families.denoiser import PredictInputs
from tasks.common.families.flow import FlowDenoiser, FlowMatchingFamily
from tasks.common.families.latent_codec import LatentCodec
from tasks.common.families.pipeline_classes import PipelineClasses
from tasks.common.families.text_conditioner import TextConditioner
from tasks.common.families.tiny import qwen_tokenizer, seeded

#: QwenImagePipeline's prompt_template_encode and prompt_template_encode_start_idx
_TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
             "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
             "<|im_start|>assistant\n")
_DROP = 34
#: the system turn's words, learned whole by the tiny tokenizer so that it is 34 tokens, as in Qwen's
_SYSTEM_WORDS = ("system", "Describe", "Ġimage", "Ġdetailing", "Ġcolor", "Ġshape", "Ġsize", "Ġtexture", "Ġquantity",
                 "Ġtext", "Ġspatial", "Ġrelationships", "Ġobjects")


class _Codec(LatentCodec):
    """Qwen-Image's 3D VAE: images in as one frame, the frame's latents out, normalised per channel."""

    def vae_input(self, pixels: Any) -> Any:
        return pixels[:, :, None]  # one frame

    def scale_latents(self, vae: Any, latents: Any) -> Any:
        """The frame's latents, (x - latents_mean) / latents_std (the pipeline decodes x * std + mean)."""
        import torch

        latents = latents[:, :, 0] if latents.ndim == 5 else latents
        shape = (1, -1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
        std = torch.tensor(vae.config.latents_std).view(shape).to(latents.device, latents.dtype)
        return (latents - mean) / std


class QwenVLText(TextConditioner):
    """Qwen2.5-VL through the pipeline's template, the system turn dropped, its mask in the pooled slot."""

    def tokenize(self, components: Any, prompts: list[str], max_sequence_length: int | None = None) -> list[Any]:
        """The pipeline's template around each prompt, padded to the system turn + `max_sequence_length`."""
        length = _DROP + (max_sequence_length or self.max_sequence_length)
        return [components.tokenizers[0]([_TEMPLATE.format(p) for p in prompts], padding="max_length",
                                         max_length=length, truncation=True, return_tensors="pt").input_ids]

    def encode_prompt(self, components: Any, input_ids: list[Any], text_encoders: list[Any] | None = None
                      ) -> tuple[Any, Any]:
        """(last hidden state after the system turn, zero where padded; its mask, float (b, L))."""
        (qwen,) = text_encoders or components.text_encoders
        ids = input_ids[0].to(next(qwen.parameters()).device)
        mask = (ids != components.tokenizers[0].pad_token_id).long()  # the template never holds the pad token
        hidden = qwen(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
        mask = mask[:, _DROP:].to(hidden.dtype)
        return hidden[:, _DROP:] * mask[..., None], mask


class QwenImageDenoiser(FlowDenoiser):
    """The double-stream MMDiT over packed latents, told each image's token grid (`img_shapes`)."""

    def predict(self, denoiser: Any, noisy_latents: Any, timesteps: Any, hidden: Any, pooled: Any,
                inputs: PredictInputs) -> Any:
        """`pooled` is the text mask (see the module's docstring)."""
        from diffusers import QwenImagePipeline

        b, c, h, w = noisy_latents.shape
        packed = QwenImagePipeline._pack_latents(noisy_latents, b, c, h, w)
        pred = denoiser(hidden_states=packed, timestep=timesteps / 1000, encoder_hidden_states=hidden,
                        encoder_hidden_states_mask=pooled, img_shapes=[[(1, h // 2, w // 2)]] * b,
                        return_dict=False)[0]
        return QwenImagePipeline._unpack_latents(pred, h, w, 1)[:, :, 0]  # latent sizes: scale factor 1

    def latent_shape(self, pipe: Any, height: int, width: int) -> tuple[int, ...]:
        """Packed: (h/2 x w/2 latent tokens, 4 x the VAE's channels), as QwenImagePipeline takes `latents`."""
        vsf = int(pipe.vae_scale_factor)
        return ((height // vsf // 2) * (width // vsf // 2), int(pipe.transformer.config["in_channels"]))


class QwenImage(FlowMatchingFamily):
    name = "qwenimage"
    title = "Qwen-Image"
    builtin = "builtin:tiny-qwenimage"
    pipeline = PipelineClasses(("QwenImagePipeline",))
    text = QwenVLText(trainable=(), max_sequence_length=512,  # QwenImagePipeline.__call__'s length
                      frozen_because="its LoRA loader has no text part", trains_embeddings=False)
    codec = _Codec(pixel_multiple=16)
    export = replace(FlowMatchingFamily.export, ov_pipeline="OVQwenImagePipeline")
    # the negative prompt's pass is a separate call; weighting_scheme "none" is
    # train_dreambooth_lora_qwen_image.py's default
    denoiser = QwenImageDenoiser(guidance_in_batch=False, takes_guidance_scale=False)

    @classmethod
    def call_convention(cls) -> CallConvention:
        """True classifier-free guidance (`true_cfg_scale`), with a blank negative prompt when guided."""
        return replace(super().call_convention(), guidance_argument="true_cfg_scale", negative_when_guided=" ")

    @classmethod
    def build_tiny(cls, seed: int) -> Any:
        """A 2-layer Qwen2.5-VL 16 wide (a 1-block vision tower the pipeline never runs), two
        transformer blocks, a 16-wide 3D VAE with 4 latent channels (x4), Qwen-Image's scheduler."""
        from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline

        tokenizer = qwen_tokenizer(max_length=1024 + _DROP, extra_words=_SYSTEM_WORDS)
        transformer = tiny_transformer(seed)
        vae = seeded(seed + 1, lambda: AutoencoderKLQwenImage(
            base_dim=16, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1, temperal_downsample=[False, True],
            **_latent_statistics(seed + 1, 4)))
        text_encoder = tiny_qwen25vl(seed + 2, tokenizer, 2048)
        scheduler = FlowMatchEulerDiscreteScheduler(  # Qwen/Qwen-Image's scheduler config
            shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9, base_image_seq_len=256,
            max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential")
        return QwenImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                                 transformer=transformer)


def tiny_transformer(seed: int) -> Any:
    """Two QwenImageTransformer2DModel blocks 32 wide over 4 latent channels (x4 packed)."""
    from diffusers import QwenImageTransformer2DModel

    return seeded(seed, lambda: QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=16, axes_dims_rope=(8, 4, 4)))


def tiny_qwen25vl(seed: int, tokenizer: Any, max_positions: int, **token_ids: int) -> Any:
    """A 2-layer Qwen2.5-VL 16 wide with a 1-block vision tower; `token_ids`: its vision tokens' ids."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=max_positions,
                         rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2],
                                          "rope_theta": 1000000.0},
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
                         eos_token_id=tokenizer.eos_token_id, use_cache=False),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=16,
                           fullatt_block_indexes=[0]),
        **token_ids)
    return seeded(seed, lambda: Qwen2_5_VLForConditionalGeneration(config))


def _latent_statistics(seed: int, channels: int) -> dict[str, list[float]]:
    """latents_mean / latents_std away from (0, 1), drawn from `seed`, so that the normalisation
    training and the pipeline apply is not the identity (a real VAE's are not)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    mean = (0.2 * torch.randn(channels, generator=g)).tolist()
    std = torch.empty(channels).uniform_(0.7, 1.5, generator=g).tolist()
    return {"latents_mean": [round(v, 4) for v in mean], "latents_std": [round(v, 4) for v in std]}
