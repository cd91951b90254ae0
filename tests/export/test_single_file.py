"""The single-file checkpoint read back by diffusers' own reader (from_single_file)."""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from tasks.common.errors import UserError
from tasks.export.single_file import original_state_dict, write_single_file
from tests.export.tiny_ov import tiny_pipeline


def test_diffusers_reads_back_every_weight(tmp_path_factory, tmp_path):
    """Written from the seed-0 model, read with the seed-1 model's folder as config: every tensor
    must equal seed 0's, so the weights came from the file through diffusers' key conversion."""
    from diffusers import StableDiffusionPipeline

    src = tiny_pipeline(tmp_path_factory, "builtin:tiny-sd")
    other = tiny_pipeline(tmp_path_factory, "builtin:tiny-sd", seed=1)
    path = tmp_path / "model.safetensors"
    info = write_single_file(src, path, dtype="fp32")
    assert info["dtype"] == "fp32" and info["tensors"] > 400 and info["size_mb"] > 1
    with safe_open(str(path), "pt") as fh:
        keys = set(fh.keys())
    assert "model.diffusion_model.input_blocks.0.0.weight" in keys  # the original layout
    assert "first_stage_model.decoder.mid.attn_1.q.weight" in keys
    assert any(k.startswith("cond_stage_model.transformer.text_model.") for k in keys)

    back = StableDiffusionPipeline.from_single_file(str(path), config=str(other),
                                                    local_files_only=True)
    orig = StableDiffusionPipeline.from_pretrained(src)
    for name in ("unet", "vae", "text_encoder"):
        want, got = getattr(orig, name).state_dict(), getattr(back, name).state_dict()
        assert set(want) == set(got), name
        for key, value in want.items():
            assert torch.equal(value, got[key].reshape(value.shape)), f"{name}.{key}"


def test_fp16_file_and_sdxl_refused(tmp_path_factory, tmp_path):
    src = tiny_pipeline(tmp_path_factory, "builtin:tiny-sd")
    path = tmp_path / "model.safetensors"
    write_single_file(src, path)  # fp16 by default: what the tools expect, half the size
    with safe_open(str(path), "pt") as fh:
        assert fh.get_tensor("model.diffusion_model.out.2.weight").dtype == torch.float16

    from diffusers import StableDiffusionXLPipeline

    xl_folder = tiny_pipeline(tmp_path_factory, "builtin:tiny-sdxl")
    xl = StableDiffusionXLPipeline.from_pretrained(xl_folder)
    with pytest.raises(UserError, match="SD 1.x only"):
        original_state_dict(xl)
