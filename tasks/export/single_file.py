"""An SD 1.x pipeline as one safetensors file in the original (CompVis/LDM) layout.

Tools such as AUTOMATIC1111, ComfyUI and kohya's scripts take one `.safetensors` checkpoint with
the original key names (`model.diffusion_model.*`, `first_stage_model.*`,
`cond_stage_model.transformer.*`) instead of a diffusers folder; diffusers reads such a file with
`StableDiffusionPipeline.from_single_file`. Diffusers ships only the reading direction, so the
writing one is here: a renaming of keys (plus the VAE attention's linear weights as 1x1
convolutions). The test converts back with diffusers' own reader and compares every tensor.

Only SD 1.x: SD 2.x's original text encoder is OpenCLIP with another layout, and SDXL has two
text encoders in yet another one; both get a UserError that says to use the diffusers folder.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from tasks.common.errors import UserError

log = logging.getLogger(__name__)

#: Where the export stage puts the file, inside its output folder (`export.single_file`).
SINGLE_FILE = Path("single_file") / "model.safetensors"

UNET_PREFIX = "model.diffusion_model."
VAE_PREFIX = "first_stage_model."
TEXT_PREFIX = "cond_stage_model.transformer."

_UNET_TOP = {
    "time_embedding.linear_1.": "time_embed.0.",
    "time_embedding.linear_2.": "time_embed.2.",
    "conv_in.": "input_blocks.0.0.",
    "conv_norm_out.": "out.0.",
    "conv_out.": "out.2.",
}
_UNET_RESNET = {
    "norm1.": "in_layers.0.",
    "conv1.": "in_layers.2.",
    "norm2.": "out_layers.0.",
    "conv2.": "out_layers.3.",
    "time_emb_proj.": "emb_layers.1.",
    "conv_shortcut.": "skip_connection.",
}
_VAE_RESNET = {"conv_shortcut.": "nin_shortcut."}
_VAE_ATTENTION = {
    "group_norm.": "norm.",
    "to_q.": "q.",
    "to_k.": "k.",
    "to_v.": "v.",
    "to_out.0.": "proj_out.",
}


def _unet_blocks(config: Any) -> dict[str, tuple[str, dict[str, str]]]:
    """diffusers block prefix -> (original prefix, renames inside the block)."""
    n = config["layers_per_block"]
    if not isinstance(n, int):
        raise UserError(
            "export.single_file: a UNet with per-level layers_per_block is not supported"
        )
    levels = len(config["block_out_channels"])
    blocks: dict[str, tuple[str, dict[str, str]]] = {}
    for i in range(levels):
        for j in range(n):
            blocks[f"down_blocks.{i}.resnets.{j}."] = (f"input_blocks.{(n + 1) * i + j + 1}.0.",
                                                       _UNET_RESNET)
            blocks[f"down_blocks.{i}.attentions.{j}."] = (f"input_blocks.{(n + 1) * i + j + 1}.1.",
                                                          {})
        if i < levels - 1:
            blocks[f"down_blocks.{i}.downsamplers.0.conv."] = (
                f"input_blocks.{(n + 1) * (i + 1)}.0.op.", {}
            )
        up_has_attention = "CrossAttn" in config["up_block_types"][i]
        for j in range(n + 1):
            blocks[f"up_blocks.{i}.resnets.{j}."] = (f"output_blocks.{(n + 1) * i + j}.0.",
                                                     _UNET_RESNET)
            blocks[f"up_blocks.{i}.attentions.{j}."] = (f"output_blocks.{(n + 1) * i + j}.1.", {})
        if i < levels - 1:
            slot = 2 if up_has_attention else 1
            blocks[f"up_blocks.{i}.upsamplers.0."] = (
                f"output_blocks.{(n + 1) * i + n}.{slot}.", {}
            )
    blocks["mid_block.attentions.0."] = ("middle_block.1.", {})
    for j in range(2):
        blocks[f"mid_block.resnets.{j}."] = (f"middle_block.{2 * j}.", _UNET_RESNET)
    for old, new in _UNET_TOP.items():
        blocks[old] = (new, {})
    return blocks


def _vae_blocks(levels: int) -> dict[str, tuple[str, dict[str, str]]]:
    blocks: dict[str, tuple[str, dict[str, str]]] = {}
    for i in range(levels):
        blocks[f"encoder.down_blocks.{i}.downsamplers.0."] = (f"encoder.down.{i}.downsample.", {})
        blocks[f"decoder.up_blocks.{i}.upsamplers.0."] = (
            f"decoder.up.{levels - 1 - i}.upsample.", {}
        )
        for j in range(8):  # resnets per level: layers_per_block (+1 in the decoder), never 8
            blocks[f"encoder.down_blocks.{i}.resnets.{j}."] = (f"encoder.down.{i}.block.{j}.",
                                                               _VAE_RESNET)
            blocks[f"decoder.up_blocks.{i}.resnets.{j}."] = (
                f"decoder.up.{levels - 1 - i}.block.{j}.", _VAE_RESNET
            )
    for part in ("encoder", "decoder"):
        blocks[f"{part}.mid_block.attentions.0."] = (f"{part}.mid.attn_1.", _VAE_ATTENTION)
        for j in range(2):
            blocks[f"{part}.mid_block.resnets.{j}."] = (f"{part}.mid.block_{j + 1}.", _VAE_RESNET)
        blocks[f"{part}.conv_norm_out."] = (f"{part}.norm_out.", {})
    return blocks


def _rename(key: str, blocks: dict[str, tuple[str, dict[str, str]]]) -> str:
    """`key` with its longest matching block prefix replaced and the block's inner renames done."""
    for prefix in sorted((p for p in blocks if key.startswith(p)), key=len, reverse=True):
        new_prefix, inner = blocks[prefix]
        rest = key[len(prefix):]
        for old, new in inner.items():
            if rest.startswith(old):
                rest = new + rest[len(old):]
                break
        return new_prefix + rest
    return key


def original_state_dict(pipe: Any) -> dict[str, Any]:
    """The pipeline's UNet, VAE and text encoder weights under the original key names."""
    unet_config = pipe.unet.config
    if getattr(pipe, "text_encoder_2", None) is not None:
        raise UserError(
            "export.single_file supports SD 1.x only; SDXL's original file has two text encoders "
            "in another layout. Use the diffusers folder (models/finetuned) with SDXL tools"
        )
    if unet_config["cross_attention_dim"] == 1024:
        raise UserError(
            "export.single_file supports SD 1.x only; SD 2.x's original text encoder is OpenCLIP "
            "with another layout. Use the diffusers folder (models/finetuned)"
        )
    out: dict[str, Any] = {}
    unet_blocks = _unet_blocks(unet_config)
    for key, value in pipe.unet.state_dict().items():
        out[UNET_PREFIX + _rename(key, unet_blocks)] = value
    vae_blocks = _vae_blocks(len(pipe.vae.config["block_out_channels"]))
    for key, value in pipe.vae.state_dict().items():
        new = _rename(key, vae_blocks)
        if ".mid.attn_1." in new and new.endswith(".weight") and value.ndim == 2:
            value = value[:, :, None, None]  # linear -> 1x1 convolution
        out[VAE_PREFIX + new] = value
    for key, value in pipe.text_encoder.state_dict().items():
        out[TEXT_PREFIX + key] = value
    return out


def write_single_file(src: Path, dst: Path, dtype: str = "fp16") -> dict[str, Any]:
    """Save the diffusers pipeline `src` as one original-layout safetensors file `dst`."""
    import torch
    from diffusers import StableDiffusionPipeline
    from safetensors.torch import save_file

    torch_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    pipe = StableDiffusionPipeline.from_pretrained(src, torch_dtype=torch.float32)
    tensors = {k: v.to(torch_dtype).contiguous() for k, v in original_state_dict(pipe).items()}
    dst.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dst), metadata={"format": "pt", "source": "sd-finetune export"})
    log.info("single-file checkpoint (%s, %d tensors) written to %s", dtype, len(tensors), dst)
    return {"dtype": dtype, "tensors": len(tensors), "size_mb": round(dst.stat().st_size / 1e6, 3)}
