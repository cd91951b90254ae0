"""Every train method's output becomes one diffusers pipeline (no OpenVINO: seconds each)."""
from __future__ import annotations

import pytest
import torch

from tasks.common.errors import UserError
from tasks.export.source import detect, materialize
from tests.export.adapters import TOKEN, write_adapters
from tests.export.tiny_ov import tiny_pipeline

pytestmark = pytest.mark.quick  # make test-fast


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tiny_pipeline(tmp_path_factory, "builtin:tiny-sd")


def _unet_distance(a, b) -> float:
    return sum((p - q).abs().sum().item() for p, q in zip(a.unet.parameters(), b.unet.parameters()))


def test_full_pipeline_is_used_as_is(base, tmp_path):
    out, info = materialize(base, None, tmp_path)
    assert out == base and info == {"method": "full_pipeline"}
    assert not list(tmp_path.iterdir())


def test_lora_is_fused_into_the_unet(base, tmp_path):
    from diffusers import StableDiffusionPipeline

    adapters = write_adapters(base, tmp_path / "lora", embeds=False)
    assert detect(adapters).method == "lora"
    out, info = materialize(adapters, base, tmp_path / "work")
    assert info["method"] == "lora" and "tokens" not in info
    merged = StableDiffusionPipeline.from_pretrained(out)
    plain = StableDiffusionPipeline.from_pretrained(base)
    assert _unet_distance(merged, plain) > 1.0
    assert not any("lora" in name for name, _ in merged.unet.named_parameters())
    # The fused pipeline computes what base + loaded LoRA computes.
    plain.load_lora_weights(adapters, weight_name="pytorch_lora_weights.safetensors")
    kwargs = dict(prompt="a toy", num_inference_steps=2, output_type="np")
    a = merged(generator=torch.Generator().manual_seed(0), **kwargs).images
    b = plain(generator=torch.Generator().manual_seed(0), **kwargs).images
    assert abs(a - b).max() < 1e-4


def test_textual_inversion_token_is_added(base, tmp_path):
    from diffusers import StableDiffusionPipeline

    adapters = write_adapters(base, tmp_path / "ti", lora=False)
    out, info = materialize(adapters, base, tmp_path / "work")
    assert info["method"] == "textual_inversion" and info["tokens"] == [TOKEN]
    merged = StableDiffusionPipeline.from_pretrained(out)
    token_id = merged.tokenizer.convert_tokens_to_ids(TOKEN)
    assert token_id == len(merged.tokenizer) - 1
    assert merged.tokenizer(f"a {TOKEN} toy").input_ids.count(token_id) == 1
    assert _unet_distance(merged, StableDiffusionPipeline.from_pretrained(base)) == 0.0


def test_adapters_without_base_or_files_are_user_errors(base, tmp_path):
    adapters = write_adapters(base, tmp_path / "ti", lora=False)
    with pytest.raises(UserError, match="--base models/base"):
        materialize(adapters, None, tmp_path / "work")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="neither a pipeline"):
        detect(tmp_path / "empty")
    with pytest.raises(UserError, match="run the train stage first"):
        detect(tmp_path / "missing")


def test_sdxl_embedding_needs_its_token(base, tmp_path):
    from safetensors.torch import save_file

    folder = tmp_path / "sdxl-ti"
    folder.mkdir()
    save_file({"clip_l": torch.zeros(1, 32), "clip_g": torch.zeros(1, 32)},
              folder / "learned_embeds.safetensors")
    with pytest.raises(UserError, match="export.placeholder_token"):
        materialize(folder, base, tmp_path / "work")
