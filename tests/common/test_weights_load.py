"""load_in_dtype: the same model as from_pretrained(torch_dtype=...), loaded a chunk of tensors at a time."""
from __future__ import annotations

import json

import pytest
import torch

from tasks.common import families, weights_load
from tasks.common.weights_load import load_in_dtype

pytestmark = pytest.mark.quick  # make test-fast


def assert_same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for key in sa:
        assert sa[key].dtype == sb[key].dtype and torch.equal(sa[key], sb[key]), key
    assert dict(a.config) == dict(b.config) and not a.training


@pytest.fixture(scope="module")
def tiny_bases(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = {}
    for kind in ("builtin:tiny-sd", "builtin:tiny-flux"):
        out[kind] = families.build_tiny_pipeline(kind, 0, tmp_path_factory.mktemp(kind.split("-")[-1]))
    return out


@pytest.mark.parametrize("kind", ["builtin:tiny-sd", "builtin:tiny-flux"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_denoiser_loads_as_from_pretrained_loads_it(tiny_bases, kind, dtype, monkeypatch) -> None:
    family = families.BUILTINS[kind]
    base = tiny_bases[kind]
    model_class = type(family.denoiser.load(base))
    monkeypatch.setattr(weights_load, "CHUNK", 7)  # several mappings of the file, and a partial last one
    ours = family.denoiser.load(base, dtype)
    assert_same(ours, model_class.from_pretrained(base, subfolder=family.denoiser.name, torch_dtype=dtype))
    assert not any(t.is_meta for t in ours.state_dict().values())


def test_sharded_weights_load_from_every_shard(tiny_bases, tmp_path) -> None:
    from diffusers import UNet2DConditionModel

    unet = UNet2DConditionModel.from_pretrained(tiny_bases["builtin:tiny-sd"], subfolder="unet")
    unet.save_pretrained(tmp_path / "unet", max_shard_size="20KB")
    shards = set(json.loads((tmp_path / "unet/diffusion_pytorch_model.safetensors.index.json").read_text())
                 ["weight_map"].values())
    assert len(shards) > 2
    assert_same(load_in_dtype(UNet2DConditionModel, tmp_path, "unet", torch.bfloat16),
                UNet2DConditionModel.from_pretrained(tmp_path, subfolder="unet", torch_dtype=torch.bfloat16))


def test_keys_the_model_does_not_have_go_through_from_pretrained(tiny_bases, tmp_path) -> None:
    """A file with a key the model lacks is left to diffusers' loader (which converts or warns), whole."""
    from diffusers import UNet2DConditionModel
    from safetensors.torch import load_file, save_file

    unet = UNet2DConditionModel.from_pretrained(tiny_bases["builtin:tiny-sd"], subfolder="unet")
    unet.save_pretrained(tmp_path / "unet")
    path = tmp_path / "unet/diffusion_pytorch_model.safetensors"
    weights = load_file(path)
    save_file({**weights, "extra.weight": torch.ones(2)}, path)
    assert_same(load_in_dtype(UNet2DConditionModel, tmp_path, "unet", torch.bfloat16),
                UNet2DConditionModel.from_pretrained(tmp_path, subfolder="unet", torch_dtype=torch.bfloat16))
