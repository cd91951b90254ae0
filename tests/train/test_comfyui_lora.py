"""`train.lora_format: comfyui`: the trained adapters as one file under ComfyUI's keys
(tasks/common/comfyui_lora.py), written by the LoRA method's own `save`.

- Where diffusers has a converter for the family's ComfyUI keys (SD and SDXL: kohya's `lora_unet_`,
  `lora_te*_`; FLUX.1: OneTrainer's `lora_transformer_`; Z-Image and Qwen-Image: `diffusion_model.`),
  `pipe.load_lora_weights` on the ComfyUI file generates the same latents, bit for bit, as on
  diffusers' own file.
- Where it has none (SD3's `lora_transformer_`, FLUX.2's and Sana's `diffusion_model.`, `lycoris_`
  for LoKr/LoHa on the DiT families), every key stem is checked against the module names and weight
  shapes of the real model, the way ComfyUI's key map is built from them.
- LoKr and LoHa load with the LyCORIS library (kohya's network and its own) to the same per-layer
  weight deltas as peft's `get_delta_weight`.
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tasks.common import families
from tasks.common.adapters import peft_config
from tasks.common.comfyui_lora import COMFYUI_LORA_NAME, SUFFIXES, prefixes, stem
from tasks.train.config import TrainConfig
from tasks.train.methods.lora import WEIGHT_NAME, LoRA


def adapted(base: Path, lora_type: str, text: bool = False, rank: int = 4, alpha: float | None = None,
            seed: int = 0) -> tuple[object, dict[str, torch.nn.Module]]:
    """The tiny pipeline with peft adapters (as the LoRA method adds them) on its denoiser (and its
    trainable text encoders), every adapter weight random (a trained adapter, not peft's zero init)."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(base)
    family = families.of_pipeline(pipe)
    names = {family.denoiser_name: family.lora_targets}
    if text:
        names.update({n: family.text_lora_targets for n in family.trainable_text_encoders or family.text_encoder_names})
    generator = torch.Generator().manual_seed(seed)
    trained = {}
    for name, targets in names.items():
        module = getattr(pipe, name)
        module.add_adapter(peft_config(lora_type, rank, alpha, 0.0, list(targets)))
        for pname, param in module.named_parameters():
            if "lora_" in pname or "hada_" in pname or "lokr_" in pname:
                param.data = torch.randn(param.shape, generator=generator) * 0.1 + (1.0 if "magnitude" in pname else 0)
        trained[name] = module
    return pipe, trained


def save(tmp_path: Path, pipe: object, trained: dict, lora_type: str, **kw) -> Path:
    """The LoRA method's `save` with lora_format: comfyui, into a fresh folder."""
    method = LoRA(TrainConfig(method="lora", lora_type=lora_type, lora_format="comfyui", rank=4, **kw))
    method._components = SimpleNamespace(family=families.of_pipeline(pipe))
    out = tmp_path / f"out-{lora_type}"
    out.mkdir()
    method.save(Path("unused"), out, trained)
    return out


def transformers5_clip_names(state: dict, pipe: object) -> dict:
    """The ComfyUI file's CLIP keys as diffusers 0.40 must see them to find the layers of
    transformers 5's CLIPTextModel, which has no `text_model` level (CLIPTextModelWithProjection
    keeps it): a kohya file from any trainer has it, and ComfyUI maps
    `lora_te_text_model_encoder_layers_<n>_...`. Nothing else changes."""
    flat = {p for p, name in (("lora_te_", "text_encoder"), ("lora_te1_", "text_encoder"),
                              ("lora_te2_", "text_encoder_2")) if not hasattr(getattr(pipe, name, None), "text_model")}
    return {k.replace("_text_model_encoder_", "_encoder_", 1) if k.startswith(tuple(flat)) else k: v
            for k, v in state.items()}


def latents(base: Path, lora: Path | dict | None) -> torch.Tensor:
    """Two denoising steps of the base with the adapters loaded by diffusers' own loader."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(base)
    if isinstance(lora, Path):
        pipe.load_lora_weights(lora.parent, weight_name=lora.name)
    elif lora is not None:
        pipe.load_lora_weights(lora)
    family = families.of_pipeline(pipe)
    return family.generate(pipe, "a photo", steps=2, height=32, width=32, output_type="latent",
                           generator=torch.Generator().manual_seed(0))[0]


@pytest.mark.parametrize(("name", "lora_type", "text"), [
    ("sd", "lora", True), ("sdxl", "lora", True), ("flux", "lora", False), ("zimage", "lora", False),
    ("qwenimage", "lora", False)])
def test_diffusers_loads_the_comfyui_file_to_the_same_images(tmp_path, request, name, lora_type, text) -> None:
    base = request.getfixturevalue(f"tiny_{name}")
    pipe, trained = adapted(base, lora_type, text)
    out = save(tmp_path, pipe, trained, lora_type, train_text_encoder=text)
    comfy = load_file(out / COMFYUI_LORA_NAME)
    family = families.of_pipeline(pipe)
    assert {k.split(".")[0].split("_")[0] for k in comfy} <= {p.split(".")[0].split("_")[0] for p in
                                                              prefixes(family, lora_type).values()}
    if text:
        assert {k.split("_")[1] for k in comfy if k.startswith("lora_te")} == {
            p.split("_")[1] for n, p in prefixes(family, lora_type).items() if n.startswith("text_encoder")}
        assert all("_text_model_encoder_layers_" in k for k in comfy if k.startswith("lora_te")), "ComfyUI's names"
        assert any(k.startswith("lora_te") for k in comfy)
    plain = latents(base, None)
    ours, theirs = latents(base, out / WEIGHT_NAME), latents(base, transformers5_clip_names(comfy, pipe))
    assert not torch.equal(plain, ours), "the adapters change the images"
    assert torch.equal(ours, theirs)
