"""The single-file checkpoint read back by diffusers' own reader (from_single_file).

Each layout (SD 1.x, SD 2.x, SDXL) is written from a seed-0 model and read back with a seed-1
model's folder as config: every tensor must equal seed 0's, so the weights came from the file
through diffusers' key conversion, not from the config folder.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tasks.common.errors import UserError
from tasks.export.single_file import check_layout_supported, write_single_file
from tests.export.tiny_ov import tiny_pipeline

pytestmark = pytest.mark.quick  # make test-fast


def assert_read_back(pipeline_cls, src: Path, other: Path, path: Path, parts: tuple[str, ...]):
    back = pipeline_cls.from_single_file(str(path), config=str(other), local_files_only=True)
    orig = pipeline_cls.from_pretrained(src)
    for name in parts:
        want, got = getattr(orig, name).state_dict(), getattr(back, name).state_dict()
        assert set(want) == set(got), name
        for key, value in want.items():
            assert torch.equal(value, got[key].reshape(value.shape)), f"{name}.{key}"


def file_keys(path: Path) -> set[str]:
    with safe_open(str(path), "pt") as fh:
        return set(fh.keys())


def test_sd1_read_back(tmp_path_factory, tmp_path):
    from diffusers import StableDiffusionPipeline

    src = tiny_pipeline(tmp_path_factory, "builtin:tiny-sd")
    other = tiny_pipeline(tmp_path_factory, "builtin:tiny-sd", seed=1)
    path = tmp_path / "model.safetensors"
    info = write_single_file(src, path, dtype="fp32")
    assert info["layout"] == "sd1" and info["dtype"] == "fp32"
    assert info["tensors"] > 400 and info["size_mb"] > 1
    keys = file_keys(path)
    assert "model.diffusion_model.input_blocks.0.0.weight" in keys  # the original layout
    assert "first_stage_model.decoder.mid.attn_1.q.weight" in keys
    assert any(k.startswith("cond_stage_model.transformer.text_model.") for k in keys)
    assert_read_back(StableDiffusionPipeline, src, other, path, ("unet", "vae", "text_encoder"))


def tiny_sd2(seed: int, out: Path) -> Path:
    """builtin:tiny-sd with SD 2.x's text width (1024), which selects the OpenCLIP layout."""
    from diffusers import StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    from tasks.common.families import StableDiffusion

    if (out / "model_index.json").is_file():
        return out
    pipe = StableDiffusion.build_tiny(seed)
    torch.manual_seed(seed)
    unet = UNet2DConditionModel.from_config({**pipe.unet.config, "cross_attention_dim": 1024})
    text = CLIPTextModel(CLIPTextConfig(**{**pipe.text_encoder.config.to_dict(),
                                           "hidden_size": 1024, "num_attention_heads": 8}))
    StableDiffusionPipeline(**{**pipe.components, "unet": unet, "text_encoder": text}
                            ).save_pretrained(out, safe_serialization=True)
    return out


def test_sd2_open_clip_layout_read_back(tmp_path_factory, tmp_path):
    from diffusers import StableDiffusionPipeline

    base = tmp_path_factory.getbasetemp() / "tiny-pipelines"
    src, other = tiny_sd2(0, base / "sd2-0"), tiny_sd2(1, base / "sd2-1")
    path = tmp_path / "model.safetensors"
    assert write_single_file(src, path, dtype="fp32")["layout"] == "sd2"
    keys = file_keys(path)
    assert "cond_stage_model.model.transformer.resblocks.0.attn.in_proj_weight" in keys
    assert "cond_stage_model.model.positional_embedding" in keys
    assert not any(k.startswith("cond_stage_model.transformer.") for k in keys)
    assert_read_back(StableDiffusionPipeline, src, other, path, ("unet", "vae", "text_encoder"))


def test_sdxl_two_encoders_read_back(tmp_path_factory, tmp_path):
    """SDXL with encoders of two widths, as the real ones (768, 1280): diffusers' reader tells
    them apart by width, so the default tiny model (both 32) would load one encoder twice."""
    from diffusers import StableDiffusionXLPipeline

    from tasks.common.families import StableDiffusionXL

    folders = []
    for seed in (0, 1):
        folder = tmp_path_factory.getbasetemp() / "tiny-pipelines" / f"sdxl-wide-{seed}"
        if not (folder / "model_index.json").is_file():
            StableDiffusionXL.build_tiny(seed, text_2_width=48).save_pretrained(folder, safe_serialization=True)
        folders.append(folder)
    path = tmp_path / "model.safetensors"
    info = write_single_file(folders[0], path, dtype="fp32")
    assert info["layout"] == "sdxl"
    keys = file_keys(path)
    assert "model.diffusion_model.label_emb.0.0.weight" in keys  # size/crop conditioning
    assert "conditioner.embedders.1.model.text_projection" in keys
    assert "conditioner.embedders.1.model.transformer.resblocks.1.attn.in_proj_bias" in keys
    assert any(k.startswith("conditioner.embedders.0.transformer.text_model.") for k in keys)
    assert_read_back(StableDiffusionXLPipeline, folders[0], folders[1], path,
                     ("unet", "vae", "text_encoder", "text_encoder_2"))


def test_fp16_by_default_and_refiner_refused(tmp_path_factory, tmp_path):
    src = tiny_pipeline(tmp_path_factory, "builtin:tiny-sd")
    path = tmp_path / "model.safetensors"
    write_single_file(src, path)  # fp16 by default: what the tools expect, half the size
    with safe_open(str(path), "pt") as fh:
        assert fh.get_tensor("model.diffusion_model.out.2.weight").dtype == torch.float16

    check_layout_supported({"_class_name": "StableDiffusionXLPipeline",
                            "text_encoder": ["transformers", "CLIPTextModel"],
                            "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"]})
    with pytest.raises(UserError, match="refiner"):
        check_layout_supported({"_class_name": "StableDiffusionXLImg2ImgPipeline", "text_encoder": [None, None],
                                "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"]})
