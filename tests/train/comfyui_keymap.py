"""ComfyUI's LoRA key maps, as facts written down for the tests (not ComfyUI's code): which key stems
its `LoraLoader` maps to a weight of each model type, and which tensor names it reads under a stem.
A file key outside them is what ComfyUI logs as "lora key not loaded: <key>".

Read from Comfy-Org/ComfyUI's source at these commits (the stored versions read; see COMFYUI_SOURCE):
- comfy/lora.py `model_lora_keys_unet`, `model_lora_keys_clip`, `load_lora` (LORA_CLIP_MAP);
- comfy/utils.py `unet_to_diffusers` (TRANSFORMER_BLOCKS, UNET_MAP_*), `mmdit_to_diffusers`,
  `flux_to_diffusers` (FLUX.1 and FLUX.2's single-block names), `z_image_to_diffusers`;
- comfy/weight_adapter/{lora,loha,lokr}.py `load` (the tensor names under a stem), comfy/sd.py
  `load_lora_for_models` (the model's and the CLIP's maps together; comfy/lora_convert.py rewrites
  none of our keys), comfy/ldm/qwen_image/model.py (Qwen-Image's module names are diffusers').

What is left out makes the check stricter, never looser: the stems under ComfyUI's own checkpoint
names for the UNet (ldm's `input_blocks...`) and SD3 (`joint_blocks...`), the T5 and `text_encoders.`
keys (this project never trains T5), other trainers' layouts (diffusers' `transformer.`, peft's
`base_model.model.`) for the families whose file does not use them. Block and layer counts are the
model's (ComfyUI reads them from the checkpoint it loads).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

#: the files read, and the commit of each stored version read
COMFYUI_SOURCE = {
    "comfy/lora.py": "ec93dcacb96b922f7cb1417b3ba22bccb082df32",
    "comfy/utils.py": "b3be02d6e766a8d3743dcf99cc967118f3ec8e3e",
    "comfy/weight_adapter/, comfy/sd.py, comfy/lora_convert.py, comfy/ldm/qwen_image/model.py":
        "a125cd84b054a57729b5eecab930ca9408719832",
}

#: the ComfyUI model (comfy/model_base.py class whose key map applies) and CLIP slots of each family's
#: text encoders, in the family's `text.encoder_names` order; None: ComfyUI has no such model (Sana)
COMFYUI_MODELS: dict[str, tuple[str, tuple[str, ...]] | None] = {
    "sd": ("unet", ("clip_l",)),
    "sdxl": ("unet", ("clip_l", "clip_g")),
    "sd3": ("mmdit", ("clip_l", "clip_g", "t5xxl")),
    "flux": ("flux", ("clip_l", "t5xxl")),
    "flux2": ("flux", ("qwen3",)),  # model_base.Flux2 is a Flux: flux_to_diffusers' map applies
    "zimage": ("lumina2", ("qwen3",)),  # ZImage is a Lumina2 model: z_image_to_diffusers' map
    "qwenimage": ("qwenimage", ("qwen25vl",)),
    "sana": None,
    "kontext": ("flux", ("clip_l", "t5xxl")),  # ComfyUI loads FLUX.1 Kontext as a Flux model
    "qwenimage-edit": ("qwenimage", ("qwen25vl",)),  # Qwen-Image-Edit is a QwenImage model in ComfyUI
}

# --- stems: (prefix, dotted) -> "prefix" + path, its dots as "_" unless dotted ---------------------


def _stems(paths: Iterable[str], prefixes: dict[str, bool]) -> set[str]:
    return {p + (path if dotted else path.replace(".", "_")) for path in paths for p, dotted in prefixes.items()}


# UNet (SD, SDXL): unet_to_diffusers names diffusers' modules; each maps as lora_unet_/lycoris_ + path.
_TRANSFORMER_BLOCK = ("norm1", "norm2", "norm3", "attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
                      "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0", "ff.net.0.proj", "ff.net.2")
_ATTENTIONS = ("proj_in", "proj_out", "norm")
_RESNET = ("conv1", "time_emb_proj", "conv2", "conv_shortcut", "norm1", "norm2")
_UNET_BASIC = ("class_embedding.linear_1", "class_embedding.linear_2", "add_embedding.linear_1",
               "add_embedding.linear_2", "conv_in", "conv_norm_out", "conv_out", "time_embedding.linear_1",
               "time_embedding.linear_2")


def _unet_block(prefix: str, block: Any, sampler: str | None) -> list[str]:
    paths = [f"{prefix}.resnets.{i}.{r}" for i in range(len(block.resnets)) for r in _RESNET]
    for i, attention in enumerate(getattr(block, "attentions", None) or ()):
        paths += [f"{prefix}.attentions.{i}.{a}" for a in _ATTENTIONS]
        paths += [f"{prefix}.attentions.{i}.transformer_blocks.{t}.{b}"
                  for t in range(len(attention.transformer_blocks)) for b in _TRANSFORMER_BLOCK]
    return paths + ([f"{prefix}.{sampler}.0.conv"] if sampler else [])


def unet_paths(unet: Any) -> list[str]:
    paths = list(_UNET_BASIC)
    for x, block in enumerate(unet.down_blocks):
        paths += _unet_block(f"down_blocks.{x}", block, "downsamplers")
    paths += _unet_block("mid_block", unet.mid_block, None)
    for x, block in enumerate(unet.up_blocks):
        paths += _unet_block(f"up_blocks.{x}", block, "upsamplers")
    return paths


def _unet_stems(unet: Any) -> set[str]:
    paths = unet_paths(unet)
    # diffusers' own old LoRA names: `.processor.to_q`, `.to_out` (no `.0`), with or without `unet.`
    old = {p.replace(".to_", ".processor.to_") for p in paths}
    old = {p.removesuffix(".0") if p.endswith(".to_out.0") else p for p in old}
    return _stems(paths, {"lora_unet_": False, "lycoris_": False}) | _stems(old, {"": True, "unet.": True})


# SD3 (mmdit_to_diffusers): diffusers' names for each joint block, as OneTrainer's and SimpleTuner's keys
_MMDIT_BLOCK = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj",
                "attn2.to_q", "attn2.to_k", "attn2.to_v", "norm1_context.linear", "attn.to_add_out",
                "ff_context.net.0.proj", "ff_context.net.2", "attn.norm_added_q", "attn.norm_added_k",
                "norm1.linear", "attn.to_out.0", "attn.norm_q", "attn.norm_k", "attn2.to_out.0", "attn2.norm_q",
                "attn2.norm_k", "ff.net.0.proj", "ff.net.2")
_MMDIT_BASIC = ("context_embedder", "time_text_embed.timestep_embedder.linear_1",
                "time_text_embed.timestep_embedder.linear_2", "pos_embed.proj",
                "time_text_embed.text_embedder.linear_1", "time_text_embed.text_embedder.linear_2", "norm_out.linear",
                "proj_out")


def _mmdit_stems(transformer: Any) -> set[str]:
    paths = [f"transformer_blocks.{i}.{b}" for i in range(len(transformer.transformer_blocks)) for b in _MMDIT_BLOCK]
    return _stems([*paths, *_MMDIT_BASIC], {"transformer.": True, "base_model.model.": True,
                                            "lora_transformer_": False, "lycoris_": False})


# FLUX.1 and FLUX.2 (flux_to_diffusers): diffusers' name -> BFL's (ComfyUI's model); q, k, v (and the
# single block's mlp) are slices of one BFL weight. FLUX.2's `to_qkv_mlp_proj` and `to_out` are in the
# map since PR #11981 (January 2026); its BFL names map as any ComfyUI weight does (lora_unet_...).
_FLUX_DOUBLE = {"attn.to_q": "img_attn.qkv", "attn.to_k": "img_attn.qkv", "attn.to_v": "img_attn.qkv",
                "attn.add_q_proj": "txt_attn.qkv", "attn.add_k_proj": "txt_attn.qkv",
                "attn.add_v_proj": "txt_attn.qkv", "attn.to_out.0": "img_attn.proj", "norm1.linear": "img_mod.lin",
                "norm1_context.linear": "txt_mod.lin", "attn.to_add_out": "txt_attn.proj",
                "ff.net.0.proj": "img_mlp.0", "ff.net.2": "img_mlp.2", "ff_context.net.0.proj": "txt_mlp.0",
                "ff_context.net.2": "txt_mlp.2", "ff.linear_in": "img_mlp.0", "ff.linear_out": "img_mlp.2",
                "ff_context.linear_in": "txt_mlp.0", "ff_context.linear_out": "txt_mlp.2",
                "attn.norm_q": "img_attn.norm.query_norm", "attn.norm_k": "img_attn.norm.key_norm",
                "attn.norm_added_q": "txt_attn.norm.query_norm", "attn.norm_added_k": "txt_attn.norm.key_norm"}
_FLUX_SINGLE = {"attn.to_q": "linear1", "attn.to_k": "linear1", "attn.to_v": "linear1", "proj_mlp": "linear1",
                "norm.linear": "modulation.lin", "proj_out": "linear2", "attn.norm_q": "norm.query_norm",
                "attn.norm_k": "norm.key_norm", "attn.to_qkv_mlp_proj": "linear1", "attn.to_out": "linear2"}
_FLUX_BASIC = {"proj_out": "final_layer.linear", "x_embedder": "img_in",
               "time_text_embed.timestep_embedder.linear_1": "time_in.in_layer",
               "time_text_embed.timestep_embedder.linear_2": "time_in.out_layer", "context_embedder": "txt_in",
               "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
               "time_text_embed.text_embedder.linear_2": "vector_in.out_layer",
               "time_text_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
               "time_text_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
               "norm_out.linear": "final_layer.adaLN_modulation.1", "controlnet_x_embedder": "pos_embed_input"}


def flux_names(transformer: Any) -> dict[str, str]:
    """diffusers' module path -> BFL's, for each block of this transformer."""
    names = dict(_FLUX_BASIC)
    for i in range(len(transformer.transformer_blocks)):
        names.update({f"transformer_blocks.{i}.{d}": f"double_blocks.{i}.{b}" for d, b in _FLUX_DOUBLE.items()})
    for i in range(len(transformer.single_transformer_blocks)):
        names.update({f"single_transformer_blocks.{i}.{d}": f"single_blocks.{i}.{b}" for d, b in _FLUX_SINGLE.items()})
    return names


def _flux_stems(transformer: Any) -> set[str]:
    names = flux_names(transformer)
    return (_stems(names, {"transformer.": True, "": True, "lycoris_": False, "lora_transformer_": False})
            | _stems(set(names.values()), {"lora_unet_": False, "diffusion_model.": True}))


# Z-Image (Lumina2, z_image_to_diffusers, since PR #10978, late November 2025): diffusers' names of
# each layer and refiner block -> Lumina's (q, k, v are slices of `attention.qkv`)
_LUMINA_BLOCK = {"attention.to_q": "attention.qkv", "attention.to_k": "attention.qkv",
                 "attention.to_v": "attention.qkv", "attention.norm_q": "attention.q_norm",
                 "attention.norm_k": "attention.k_norm", "attention.to_out.0": "attention.out",
                 **{n: n for n in ("attention_norm1", "attention_norm2", "feed_forward.w1", "feed_forward.w2",
                                   "feed_forward.w3", "ffn_norm1", "ffn_norm2", "adaLN_modulation.0")}}
_LUMINA_BASIC = {"all_final_layer.2-1.linear": "final_layer.linear",
                 "all_final_layer.2-1.adaLN_modulation.1": "final_layer.adaLN_modulation.1",
                 "all_x_embedder.2-1": "x_embedder",
                 **{n: n for n in ("cap_embedder.0", "cap_embedder.1", "t_embedder.mlp.0", "t_embedder.mlp.2")}}


def _lumina_stems(transformer: Any) -> set[str]:
    names = dict(_LUMINA_BASIC)
    refiners = len(transformer.noise_refiner)  # ComfyUI's one n_refiner_layers for both refiners
    for stack, n in (("layers", len(transformer.layers)), ("context_refiner", refiners), ("noise_refiner", refiners)):
        names.update({f"{stack}.{i}.{d}": f"{stack}.{i}.{c}" for i in range(n) for d, c in _LUMINA_BLOCK.items()})
    return (_stems(names, {"diffusion_model.": True, "transformer.": True, "": True, "lycoris_": False})
            | _stems(set(names.values()), {"lora_unet_": False, "diffusion_model.": True}))


# Qwen-Image: ComfyUI's model has diffusers' module names; each weight maps under its own name, bare,
# `transformer.` and `lycoris_`, besides every ComfyUI weight's `diffusion_model.` and `lora_unet_`.
_QWEN_BLOCK = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj",
               "attn.to_out.0", "attn.to_add_out", "attn.norm_q", "attn.norm_k", "attn.norm_added_q",
               "attn.norm_added_k", "img_mod.1", "txt_mod.1", "img_mlp.net.0.proj", "img_mlp.net.2",
               "txt_mlp.net.0.proj", "txt_mlp.net.2")
_QWEN_BASIC = ("time_text_embed.timestep_embedder.linear_1", "time_text_embed.timestep_embedder.linear_2",
               "txt_norm", "img_in", "txt_in", "norm_out.linear", "proj_out")


def _qwen_stems(transformer: Any) -> set[str]:
    paths = [*_QWEN_BASIC, *(f"transformer_blocks.{i}.{b}" for i in range(len(transformer.transformer_blocks))
                             for b in _QWEN_BLOCK)]
    return _stems(paths, {"diffusion_model.": True, "lora_unet_": False, "": True, "transformer.": True,
                          "lycoris_": False})


# CLIP (model_lora_keys_clip): kohya's `lora_te*_text_model_encoder_layers_<n>_<layer>` (layers < 32)
_CLIP_LAYERS = ("mlp_fc1", "mlp_fc2", "self_attn_k_proj", "self_attn_q_proj", "self_attn_v_proj", "self_attn_out_proj")


def _clip_stems(layers: dict[str, int]) -> set[str]:
    """`layers`: CLIP slot (clip_l, clip_h, clip_g) -> its number of encoder layers."""
    clip_l = "clip_l" in layers
    prefixes = {"clip_h": ("lora_te_", "lora_te1_"), "clip_l": ("lora_te_", "lora_te1_"),
                "clip_g": ("lora_te2_",) if clip_l else ("lora_te_", "lora_prior_te_")}
    stems = {f"{p}text_model_encoder_layers_{b}_{layer}" for slot, n in layers.items() for p in prefixes[slot]
             for b in range(min(n, 32)) for layer in _CLIP_LAYERS}
    if "clip_g" in layers:
        stems |= {"lora_prior_te_text_projection", "lora_te2_text_projection"}
    return stems | ({"lora_te1_text_projection"} if clip_l else set())


_DENOISERS = {"unet": _unet_stems, "mmdit": _mmdit_stems, "flux": _flux_stems, "lumina2": _lumina_stems,
              "qwenimage": _qwen_stems}


def key_map(family: Any, pipe: Any) -> set[str]:
    """Every key stem ComfyUI's LoraLoader (model and CLIP) maps for `pipe` (a pipeline of `family`);
    empty for a family ComfyUI has no model for."""
    model = COMFYUI_MODELS[family.name]
    if model is None:
        return set()
    kind, slots = model
    clips = {slot: getattr(pipe, name).config.num_hidden_layers for name, slot in zip(family.text.encoder_names, slots)
             if slot.startswith("clip_")}
    return _DENOISERS[kind](getattr(pipe, family.denoiser.name)) | _clip_stems(clips)


# --- the tensors under a stem (load_lora and weight_adapter's `load`) ------------------------------
#: read whenever present under a mapped stem
_ALWAYS = ("alpha", "dora_scale")
#: LoRA and LoHa: the names of a complete layer, then those read with it when present
_ADAPTERS = ((("lora_up.weight", "lora_down.weight"), ("lora_mid.weight", "reshape_weight")),
             (("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"), ("hada_t1", "hada_t2")))
#: LoKr: each factor whole or as two low-rank halves (lokr_t2: a Tucker core, read when present)
_LOKR = (("lokr_w1",), ("lokr_w1_a", "lokr_w1_b")), (("lokr_w2",), ("lokr_w2_a", "lokr_w2_b"))
_LOKR_NAMES = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2")
_SUFFIXES = sorted({*_ALWAYS, *_LOKR_NAMES, *(n for names in _ADAPTERS for group in names for n in group)},
                   key=len, reverse=True)


def _layer(stem: str, keys: set[str]) -> set[str]:
    """The keys under `stem` that ComfyUI reads as one complete adapter layer (empty: none)."""
    def has(names: Iterable[str]) -> bool:
        return all(f"{stem}.{n}" in keys for n in names)

    read: set[str] = set()
    for complete, optional in _ADAPTERS:
        if has(complete):
            read |= {f"{stem}.{n}" for n in (*complete, *optional)}
    if all(any(has(form) for form in factor) for factor in _LOKR):
        read |= {f"{stem}.{n}" for n in _LOKR_NAMES}
    return (read | {f"{stem}.{n}" for n in _ALWAYS}) & keys if read else set()


def not_loaded(keys: Iterable[str], stems: set[str]) -> list[str]:
    """The keys of a file that ComfyUI would log as "lora key not loaded" with the key map `stems`
    (and those of a layer it cannot apply whole)."""
    keys = set(keys)
    candidates = {k[: -len(s) - 1] for k in keys for s in _SUFFIXES if k.endswith("." + s)}
    loaded = set().union(*(_layer(stem, keys) for stem in candidates & stems))
    return sorted(keys - loaded)
