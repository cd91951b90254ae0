"""A pipeline as one safetensors file in the original (CompVis/LDM, Stability) layout.

Tools such as AUTOMATIC1111, ComfyUI and kohya's scripts take one `.safetensors` checkpoint with
the original key names (`model.diffusion_model.*`, `first_stage_model.*`, and the text encoders
under `cond_stage_model.*` or `conditioner.embedders.*`) instead of a diffusers folder; diffusers
reads such a file with `from_single_file`. Diffusers ships only the reading direction, so the
writing one is here: a renaming of keys, the VAE attention's linear weights as 1x1 convolutions,
and the OpenCLIP text encoders' layout (query, key and value in one `in_proj` matrix, the
projection transposed). The tests convert back with diffusers' own reader and compare every tensor.

- SD 1.x: CLIP ViT-L text encoder under `cond_stage_model.transformer.` (transformers' keys).
- SD 2.x (cross-attention width 1024): OpenCLIP ViT-H text encoder under `cond_stage_model.model.`.
- SDXL: CLIP ViT-L under `conditioner.embedders.0.transformer.`, OpenCLIP ViT-bigG with its
  projection under `conditioner.embedders.1.model.`, and the size/crop embedding as `label_emb`.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from tasks.common import families
from tasks.common.errors import UserError

log = logging.getLogger(__name__)

#: Where the export stage puts the file, inside its output folder (`export.single_file`).
SINGLE_FILE = Path("single_file") / "model.safetensors"

UNET_PREFIX = "model.diffusion_model."
VAE_PREFIX = "first_stage_model."
#: Where each layout keeps its text encoders: (prefix, OpenCLIP layout?) per encoder, in order.
TEXT_LAYOUTS = {
    "sd1": [("cond_stage_model.transformer.", False)],
    "sd2": [("cond_stage_model.model.", True)],
    "sdxl": [("conditioner.embedders.0.transformer.", False),
             ("conditioner.embedders.1.model.", True)],
}

_UNET_TOP = {
    "time_embedding.linear_1.": "time_embed.0.",
    "time_embedding.linear_2.": "time_embed.2.",
    "conv_in.": "input_blocks.0.0.",
    "conv_norm_out.": "out.0.",
    "conv_out.": "out.2.",
    "add_embedding.linear_1.": "label_emb.0.0.",  # SDXL's size/crop and pooled-text embedding
    "add_embedding.linear_2.": "label_emb.0.2.",
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
_OPEN_CLIP_LAYER = {
    "layer_norm1.": "ln_1.",
    "layer_norm2.": "ln_2.",
    "mlp.fc1.": "mlp.c_fc.",
    "mlp.fc2.": "mlp.c_proj.",
    "self_attn.out_proj.": "attn.out_proj.",
}
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
        return new_prefix + _replace_start(key[len(prefix):], inner)
    return key


def _replace_start(key: str, renames: dict[str, str]) -> str:
    """`key` with the first of `renames`' old beginnings it has replaced by the new one."""
    for old, new in renames.items():
        if key.startswith(old):
            return new + key[len(old):]
    return key


def check_layout_supported(index: dict[str, Any]) -> None:
    """Refuse, from its model_index.json and before any export work, a pipeline with no layout."""
    why = families.from_index(index).export.single_file_refusal(index)
    if why is not None:
        raise UserError(f"export.single_file: {why}")


def layout(pipe: Any) -> str:
    """'sd1', 'sd2' or 'sdxl': which original layout `pipe` is written in (its family says)."""
    return families.of_pipeline(pipe).export.single_file_layout(pipe)


def _open_clip(state: dict[str, Any]) -> dict[str, Any]:
    """A transformers CLIP text model's weights in OpenCLIP's layout (what SD 2.x and SDXL ship)."""
    import torch

    out: dict[str, Any] = {}
    layers: dict[str, dict[str, Any]] = {}
    for key, value in state.items():
        if key.startswith("text_model.encoder.layers."):
            index, rest = key[len("text_model.encoder.layers."):].split(".", 1)
            layers.setdefault(index, {})[rest] = value
        elif key == "text_model.embeddings.token_embedding.weight":
            out["token_embedding.weight"] = value
        elif key == "text_model.embeddings.position_embedding.weight":
            out["positional_embedding"] = value
        elif key.startswith("text_model.final_layer_norm."):
            out["ln_final." + key.rsplit(".", 1)[1]] = value
        elif key == "text_projection.weight":
            out["text_projection"] = value.T  # OpenCLIP multiplies x @ projection
        elif not key.endswith("position_ids"):
            raise UserError(f"export.single_file: unexpected text-encoder weight {key!r}")
    for index, weights in layers.items():
        prefix = f"transformer.resblocks.{index}."
        for kind in ("weight", "bias"):
            out[prefix + f"attn.in_proj_{kind}"] = torch.cat(
                [weights.pop(f"self_attn.{p}_proj.{kind}") for p in ("q", "k", "v")]
            )
        out.update({prefix + _replace_start(rest, _OPEN_CLIP_LAYER): value
                    for rest, value in weights.items()})
    return out


def _transformers_clip_keys(state: dict[str, Any]) -> dict[str, Any]:
    """The CLIP text encoder's keys as transformers 4 wrote them (`text_model.` first), which the
    original checkpoints keep; transformers 5.15's CLIPTextModel drops that level (its
    CLIPTextModelWithProjection keeps it)."""
    return {key if key.startswith(("text_model.", "text_projection.")) else f"text_model.{key}": value
            for key, value in state.items()}


def original_state_dict(pipe: Any) -> dict[str, Any]:
    """The pipeline's UNet, VAE and text encoder weights under the original key names."""
    family = families.of_pipeline(pipe)
    kind = family.export.single_file_layout(pipe)
    out: dict[str, Any] = {}
    denoiser = getattr(pipe, family.denoiser.name)  # a UNet: every family with a layout has one
    unet_blocks = _unet_blocks(denoiser.config)
    for key, value in denoiser.state_dict().items():
        out[UNET_PREFIX + _rename(key, unet_blocks)] = value
    vae_blocks = _vae_blocks(len(pipe.vae.config["block_out_channels"]))
    for key, value in pipe.vae.state_dict().items():
        new = _rename(key, vae_blocks)
        if ".mid.attn_1." in new and new.endswith(".weight") and value.ndim == 2:
            value = value[:, :, None, None]  # linear -> 1x1 convolution
        out[VAE_PREFIX + new] = value
    encoders = [getattr(pipe, name, None) for name in family.text.encoder_names]
    for (prefix, open_clip), encoder in zip(TEXT_LAYOUTS[kind], encoders):
        state = _transformers_clip_keys(encoder.state_dict())
        if open_clip:
            state = _open_clip(state)
        out.update({prefix + key: value for key, value in state.items()})
    return out


def write_single_file(src: Path, dst: Path, dtype: str = "fp16") -> dict[str, Any]:
    """Save the diffusers pipeline `src` as one original-layout safetensors file `dst`."""
    import torch
    from diffusers import DiffusionPipeline
    from safetensors.torch import save_file

    torch_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    # Loaded in the file's dtype: the same values as casting at the end, at half the memory for
    # fp16/bf16 (an SDXL pipeline is 14 GB in fp32).
    pipe = DiffusionPipeline.from_pretrained(src, dtype=torch_dtype)
    kind = layout(pipe)
    tensors = {k: v.to(torch_dtype).contiguous() for k, v in original_state_dict(pipe).items()}
    del pipe
    dst.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dst), metadata={"format": "pt", "source": "sd-finetune export"})
    log.info("single-file checkpoint (%s layout, %s, %d tensors) written to %s",
             kind, dtype, len(tensors), dst)
    return {"layout": kind, "dtype": dtype, "tensors": len(tensors),
            "size_mb": round(dst.stat().st_size / 1e6, 3)}
