"""FLUX.2 [klein]: a FLUX.2 double/single-stream transformer over patchified 2x2 latents, one Qwen3
text encoder.

Conditioning (as Flux2KleinPipeline.encode_prompt builds it): the prompt goes through Qwen3's chat
template (a user turn, the assistant's opening, thinking off), padded to `max_sequence_length`; the
hidden states of layers 9, 18 and 27 side by side are the sequence; there is no pooled vector.
Latents: the VAE's sample cut into 2x2 patches (4 x the VAE's channels) and normalised by the VAE's
batch-norm running statistics; the transformer sees them packed into tokens with (t, h, w, l)
position ids, takes timesteps / 1000, and (klein) no guidance input: classifier-free guidance is
a second, separate call on the undistilled base models, and none at all on the step-distilled
ones. No text-encoder training, as diffusers' train_dreambooth_lora_flux2_klein.py: the pipeline's
LoRA loader has no Qwen3 part.
"""
from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from finetune_runtime.convention import MAX_INPUT_IMAGES, CallConvention
from tasks.common.families.denoiser import PredictInputs
from tasks.common.families.export_profile import ExportProfile
from tasks.common.families.flow import FlowDenoiser, FlowMatchingFamily, flow_scheduler
from tasks.common.families.input_images import InputImages
from tasks.common.families.latent_codec import LatentCodec
from tasks.common.families.pipeline_classes import PipelineClasses
from tasks.common.families.qwen3_chat import Qwen3Chat, Qwen3ChatText
from tasks.common.families.tiny import qwen3_config, qwen_tokenizer, seeded

#: LoRA targets of diffusers' klein script: the double-stream blocks' attention projections, the
#: single-stream blocks' fused qkv+mlp input and their output, named per block (a double-stream block's
#: `attn.to_out` is a ModuleList, so no suffix covers both); 24 covers klein 4B (20) and 9B (24).
_LORA_TARGETS = ("to_k", "to_q", "to_v", "to_out.0", "to_qkv_mlp_proj",
                 *(f"single_transformer_blocks.{i}.attn.to_out" for i in range(24)))


#: diffusers' FLUX.2 module -> BFL's, which ComfyUI's FLUX.2 model has (and kohya's `lora_unet_` names,
#: which diffusers' FLUX.2 loader converts back); a double-stream block's q, k and v are one `qkv`
_BFL_NAMES = (
    (r"^transformer_blocks\.(\d+)\.attn\.to_[qkv]$", r"double_blocks.\1.img_attn.qkv"),
    (r"^transformer_blocks\.(\d+)\.attn\.add_[qkv]_proj$", r"double_blocks.\1.txt_attn.qkv"),
    (r"^transformer_blocks\.(\d+)\.attn\.to_out\.0$", r"double_blocks.\1.img_attn.proj"),
    (r"^transformer_blocks\.(\d+)\.attn\.to_add_out$", r"double_blocks.\1.txt_attn.proj"),
    (r"^transformer_blocks\.(\d+)\.ff\.linear_in$", r"double_blocks.\1.img_mlp.0"),
    (r"^transformer_blocks\.(\d+)\.ff\.linear_out$", r"double_blocks.\1.img_mlp.2"),
    (r"^transformer_blocks\.(\d+)\.ff_context\.linear_in$", r"double_blocks.\1.txt_mlp.0"),
    (r"^transformer_blocks\.(\d+)\.ff_context\.linear_out$", r"double_blocks.\1.txt_mlp.2"),
    (r"^single_transformer_blocks\.(\d+)\.attn\.to_qkv_mlp_proj$", r"single_blocks.\1.linear1"),
    (r"^single_transformer_blocks\.(\d+)\.attn\.to_out$", r"single_blocks.\1.linear2"),
)


def _bfl_name(path: str) -> str:
    for pattern, name in _BFL_NAMES:
        if re.match(pattern, path):
            return re.sub(pattern, name, path)
    raise ValueError(f"FLUX.2 module {path} has no name in ComfyUI's (BFL's) FLUX.2 model")


def _fused(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One LoRA (or DoRA) layer for q, k and v side by side: the downs stacked, the ups block-diagonal
    (each output slice sees only its own down), alpha summed with the rank (the same alpha / rank)."""
    import torch

    fused = {"lora_down.weight": torch.cat([p["lora_down.weight"] for p in parts]),
             "lora_up.weight": torch.block_diag(*(p["lora_up.weight"] for p in parts)),
             "alpha": sum(p["alpha"] for p in parts)}
    if "dora_scale" in parts[0]:  # DoRA's magnitude is per output row: the rows stack
        fused["dora_scale"] = torch.cat([p["dora_scale"] for p in parts])
    return fused


class _Export(ExportProfile):
    """ComfyUI's FLUX.2 has BFL's module names (q, k and v fused); an edit's input images change the
    static OpenVINO pipeline's token axis and VAE encoder size."""

    def comfyui_layers(self, component: str, layers: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """LoRA and DoRA layers under BFL's module names, each block's q, k and v fused into its `qkv`."""
        if not all("lora_down.weight" in t for t in layers.values()):
            return layers
        groups: dict[str, list[tuple[str, dict[str, Any]]]] = {}
        for path, tensors in sorted(layers.items()):
            groups.setdefault(_bfl_name(path), []).append((path, tensors))
        out = {}
        for name, parts in groups.items():
            if name.endswith(".qkv"):
                order = {re.search(r"(?:to_|add_)([qkv])", p.rsplit(".", 1)[1]).group(1): t for p, t in parts}
                if sorted(order) != ["k", "q", "v"]:
                    raise ValueError(f"{name}: ComfyUI's FLUX.2 takes q, k and v together; adapt all three")
                out[name] = _fused([order["q"], order["k"], order["v"]])
            else:
                (out[name],) = [t for _, t in parts]
        return out

    def free_reference_axes(self, ov_pipe: Any) -> None:
        """The transformer's token axis (`hidden_states`, `img_ids`: the references' tokens join the
        noisy ones, as many as their sizes make) and the VAE encoder's height and width."""
        model = ov_pipe.transformer.model
        shapes = {}
        for port in model.inputs:
            if port.get_any_name() in ("hidden_states", "img_ids"):
                shapes[port] = port.get_partial_shape()
                shapes[port][1] = -1
        model.reshape(shapes)
        port = ov_pipe.vae_encoder.model.inputs[0]
        shape = port.get_partial_shape()
        shape[2], shape[3] = -1, -1
        ov_pipe.vae_encoder.model.reshape({port: shape})


class _Codec(LatentCodec):
    """FLUX.2's latents: 2x2 patches normalised with the VAE's batch-norm statistics."""

    def scale_latents(self, vae: Any, latents: Any) -> Any:
        """2x2 patches, then the VAE's batch-norm statistics (Flux2KleinPipeline._encode_vae_image's)."""
        import torch
        from diffusers import Flux2KleinPipeline

        patches = Flux2KleinPipeline._patchify_latents(latents)
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(patches.device, patches.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(patches.device,
                                                                                              patches.dtype)
        return (patches - mean) / std


class _Text(Qwen3ChatText):
    """Qwen3 through its chat template (`chat`), the chosen hidden states side by side."""

    def encode_prompt(self, components: Any, input_ids: list[Any], text_encoders: list[Any] | None = None
                      ) -> tuple[Any, Any]:
        """(the chosen hidden states side by side per token, None)."""
        import torch

        (qwen,) = text_encoders or components.text_encoders
        layers, _ = self.chat.hidden_states(qwen, input_ids[0], components.tokenizers[0].pad_token_id)
        hidden = torch.stack(layers, dim=1)
        b, n, length, width = hidden.shape
        return hidden.permute(0, 2, 1, 3).reshape(b, length, n * width), None


class _Denoiser(FlowDenoiser):
    """The FLUX.2 transformer over packed patchified latents (and the references' tokens after them)."""

    def predict(self, denoiser: Any, noisy_latents: Any, timesteps: Any, hidden: Any, pooled: Any,
                inputs: PredictInputs) -> Any:
        from diffusers import Flux2KleinPipeline

        b, c, h, w = noisy_latents.shape
        packed = Flux2KleinPipeline._pack_latents(noisy_latents)  # (b, h*w, c), row-major
        img_ids = Flux2KleinPipeline._prepare_latent_ids(noisy_latents).to(packed.device)
        if inputs.references:
            packed, img_ids = _with_references(packed, img_ids, inputs.references)
        txt_ids = Flux2KleinPipeline._prepare_text_ids(hidden).to(packed.device)
        guidance = None
        if getattr(denoiser, "module", denoiser).config.guidance_embeds:  # (DDP wraps it in .module)
            import torch

            guidance = torch.full((b,), float(inputs.guidance_scale), device=packed.device)
        pred = denoiser(hidden_states=packed, timestep=timesteps / 1000, guidance=guidance,
                        encoder_hidden_states=hidden, txt_ids=txt_ids, img_ids=img_ids, return_dict=False)[0]
        return pred[:, : h * w].permute(0, 2, 1).reshape(b, c, h, w)

    def latent_shape(self, pipe: Any, height: int, width: int) -> tuple[int, ...]:
        """Patchified, not packed: (4 x the VAE's channels, h/2, w/2); the pipeline packs `latents` itself."""
        vsf = int(pipe.vae_scale_factor)
        return (int(pipe.transformer.config["in_channels"]), height // vsf // 2, width // vsf // 2)


class Flux2Klein(FlowMatchingFamily):
    name = "flux2"
    title = "FLUX.2 [klein]"
    builtin = "builtin:tiny-flux2"
    pipeline = PipelineClasses(("Flux2KleinPipeline",))
    # Qwen3 with thinking off, its hidden states 9, 18 and 27 side by side (Flux2KleinPipeline's
    # text_encoder_out_layers), 512 tokens (Flux2KleinPipeline's); the transformer trains alone
    text = _Text(trainable=(), max_sequence_length=512, chat=Qwen3Chat(thinking=False, layers=(9, 18, 27)),
                 frozen_because="its LoRA loader has no Qwen3 part")
    codec = _Codec(pixel_multiple=16)
    # the unconditional branch is a separate call; weighting_scheme "none" is
    # train_dreambooth_lora_flux2_klein.py's default
    denoiser = _Denoiser(lora_targets=_LORA_TARGETS, guidance_in_batch=False)
    # Flux2KleinPipeline's `image` inputs: reference tokens beside the noisy ones
    inputs = InputImages(most=MAX_INPUT_IMAGES, trains=True)
    # ComfyUI's FLUX.2 has BFL's module names (comfyui_layers), kohya-style; LoKr and LoHa keep
    # diffusers' under `lycoris_` (a Kronecker or Hadamard product does not fuse)
    export = _Export(ov_pipeline="OVFlux2KleinPipeline", comfyui_lora_prefixes={"transformer": "lora_unet_"},
                     comfyui_lycoris_prefixes={"transformer": "lycoris_"})

    @classmethod
    def call_convention(cls) -> CallConvention:
        """Flux2KleinPipeline encodes an input image larger than a megapixel scaled down to one."""
        return replace(super().call_convention(), edit_pixels=1024 * 1024)

    @classmethod
    def build_tiny(cls, seed: int) -> Any:
        """A 28-layer Qwen3 16 wide (layer 27 must exist), one double- and one single-stream block,
        an 8-channel VAE; step-distilled like FLUX.2-klein-4B (no classifier-free guidance)."""
        from diffusers import AutoencoderKLFlux2, Flux2KleinPipeline, Flux2Transformer2DModel
        from transformers import Qwen3ForCausalLM

        tokenizer = qwen_tokenizer(max_length=512)
        transformer = seeded(seed, lambda: Flux2Transformer2DModel(
            patch_size=1, in_channels=32, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=48, timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4),
            guidance_embeds=False,
        ))
        vae = seeded(seed + 1, lambda: _with_latent_statistics(AutoencoderKLFlux2(
            block_out_channels=(32, 64), down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=8, layers_per_block=1, sample_size=64,
        )))
        text_encoder = seeded(seed + 2, lambda: Qwen3ForCausalLM(
            qwen3_config(len(tokenizer), tokenizer.pad_token_id, num_hidden_layers=28)))
        return Flux2KleinPipeline(scheduler=flow_scheduler(shift=3.0, dynamic=True), vae=vae, text_encoder=text_encoder,
                                  tokenizer=tokenizer, transformer=transformer, is_distilled=True)


def _with_references(packed: Any, img_ids: Any, references: list[Any]) -> tuple[Any, Any]:
    """The reference latents' tokens after the noisy target's, with their own position ids: time
    coordinate 10, 20, ... per reference (Flux2KleinPipeline._prepare_image_ids, as its
    prepare_image_latents does for `image` inputs and diffusers' klein img2img script for training).
    The prediction is read from the target's tokens only (`predict` keeps the first h*w)."""
    import torch
    from diffusers import Flux2KleinPipeline

    b = packed.shape[0]
    tokens = [Flux2KleinPipeline._pack_latents(r.to(packed.device, packed.dtype)) for r in references]
    ids = Flux2KleinPipeline._prepare_image_ids([r[:1] for r in references]).to(img_ids.device, img_ids.dtype)
    return torch.cat([packed, *tokens], dim=1), torch.cat([img_ids, ids.expand(b, -1, -1)], dim=1)


def _with_latent_statistics(vae: Any) -> Any:
    """Batch-norm statistics away from (0, 1), drawn from the same seed, so that the normalisation
    training and the pipelines apply is not the identity (a real VAE's are not)."""
    import torch

    with torch.no_grad():
        vae.bn.running_mean.copy_(0.2 * torch.randn_like(vae.bn.running_mean))
        vae.bn.running_var.copy_(torch.empty_like(vae.bn.running_var).uniform_(0.5, 2.0))
    return vae
