"""The shard-by-shard fuse (tasks/common/stream_fuse.py) writes what peft's own merge gives, for LoRA
and DoRA at a scale other than 1, across two shards; what it cannot stream it says, writing nothing."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tasks.common import stream_fuse


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.to_q = torch.nn.Linear(6, 5)
        self.to_k = torch.nn.Linear(6, 5, bias=False)
        self.norm = torch.nn.LayerNorm(5)


def _base(tmp_path: Path, block: Block) -> Path:
    """A pipeline folder whose `transformer` is `block`, in two shards, with a config beside them."""
    base = tmp_path / "base"
    (base / "transformer").mkdir(parents=True)
    (base / "scheduler").mkdir()
    index = {"_class_name": "AnyPipeline", "transformer": ["diffusers", "Block"], "scheduler": ["diffusers", "S"]}
    (base / "model_index.json").write_text(json.dumps(index))
    (base / "transformer" / "config.json").write_text("{}")
    (base / "scheduler" / "scheduler_config.json").write_text("{}")
    (base / "pytorch_lora_weights.safetensors").write_bytes(b"an older fine-tune's adapters")
    (base / "README.md").write_text("the base's card")
    state = {k: v.clone() for k, v in block.state_dict().items()}
    keys = sorted(state)
    save_file({k: state[k] for k in keys[:2]}, base / "transformer" / "a.safetensors", metadata={"format": "pt"})
    save_file({k: state[k] for k in keys[2:]}, base / "transformer" / "b.safetensors", metadata={"format": "pt"})
    return base


def _adapted(dora: bool, **config) -> tuple[Block, dict[str, torch.Tensor], Block]:
    """(the base block, its adapter's state, the block with the adapter merged by peft)."""
    from peft import LoraConfig, inject_adapter_in_model
    from peft.utils import get_peft_model_state_dict

    torch.manual_seed(0)
    block = Block()
    plain = Block()
    plain.load_state_dict(block.state_dict())
    cfg = LoraConfig(r=2, lora_alpha=6, target_modules=["to_q", "to_k"], use_dora=dora, **config)
    inject_adapter_in_model(cfg, block)
    with torch.no_grad():
        for name, param in block.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape))
    state = get_peft_model_state_dict(block)
    for module in block.modules():
        if hasattr(module, "merge"):
            module.merge()
    return plain, state, block


def _lora_file(tmp_path: Path, state: dict[str, torch.Tensor], meta: dict) -> Path:
    path = tmp_path / "lora.safetensors"
    packed = {f"transformer.{k}": v.contiguous() for k, v in state.items()}
    save_file(packed, path, metadata={"format": "pt", "lora_adapter_metadata": json.dumps(meta)})
    return path


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_streamed_fuse_equals_peft_merge(tmp_path, dora) -> None:
    plain, state, merged = _adapted(dora)
    base = _base(tmp_path, plain)
    lora = _lora_file(tmp_path, state, {"transformer.r": 2, "transformer.lora_alpha": 6})  # scale 3
    fuse, why = stream_fuse.plan(base, lora, ["transformer"])
    assert fuse is not None, why
    out = tmp_path / "out"
    out.mkdir()
    (out / "pytorch_lora_weights.safetensors").write_bytes(b"this fine-tune's adapters")
    before = {p: p.read_bytes() for p in base.rglob("*") if p.is_file()}
    assert stream_fuse.fuse_to(base, out, fuse) == {"transformer": 2}
    assert {p: p.read_bytes() for p in base.rglob("*") if p.is_file()} == before, "the base is never written"
    assert (out / "pytorch_lora_weights.safetensors").read_bytes() == b"this fine-tune's adapters"
    assert not (out / "README.md").exists(), "only model_index.json and the components it lists"
    assert (out / "scheduler" / "scheduler_config.json").samefile(base / "scheduler" / "scheduler_config.json")
    assert not (out / "transformer" / "a.safetensors").samefile(base / "transformer" / "a.safetensors")
    got = {**load_file(out / "transformer" / "a.safetensors"), **load_file(out / "transformer" / "b.safetensors")}
    want = {k.replace(".base_layer", ""): v for k, v in merged.state_dict().items() if "lora" not in k}
    assert got.keys() == want.keys()
    for key in got:
        assert torch.allclose(got[key], want[key], atol=1e-6), key
    assert not torch.equal(got["to_q.weight"], plain.to_q.weight)
    assert (out / "model_index.json").is_file() and (out / "transformer" / "config.json").is_file()


def test_what_cannot_stream_is_said_and_nothing_written(tmp_path) -> None:
    plain, state, _ = _adapted(False)
    base = _base(tmp_path, plain)
    patterned = _lora_file(tmp_path, state, {"transformer.r": 2, "transformer.lora_alpha": 6,
                                             "transformer.rank_pattern": {"to_q": 4}})
    assert stream_fuse.plan(base, patterned, ["transformer"])[1] == "transformer has per-layer rank or alpha patterns"
    renamed = _lora_file(tmp_path, {k.replace("to_k", "to_v"): v for k, v in state.items()}, {})
    fuse, why = stream_fuse.plan(base, renamed, ["transformer"])
    assert fuse is None and why == "transformer has no weight to_v.weight in its safetensors files"
    fuse, why = stream_fuse.plan(base, renamed, ["unet"])
    assert fuse is None and "is not a LoRA layer of unet" in why
    (base / "transformer" / "diffusion_pytorch_model.bin").write_bytes(b"")
    fuse, why = stream_fuse.plan(base, _lora_file(tmp_path, state, {}), ["transformer"])
    assert fuse is None and why.startswith("transformer also has diffusion_pytorch_model.bin")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base", "lora.safetensors"]


def test_a_conv2d_lora_streams_as_peft_merges_it(tmp_path) -> None:
    from peft import LoraConfig, inject_adapter_in_model
    from peft.utils import get_peft_model_state_dict

    torch.manual_seed(0)
    block, plain = torch.nn.Module(), torch.nn.Module()
    block.conv, plain.conv = torch.nn.Conv2d(3, 4, 3), torch.nn.Conv2d(3, 4, 3)
    plain.load_state_dict(block.state_dict())
    inject_adapter_in_model(LoraConfig(r=2, lora_alpha=4, target_modules=["conv"]), block)
    with torch.no_grad():
        block.conv.lora_B["default"].weight.copy_(torch.randn(4, 2, 1, 1))
    state = get_peft_model_state_dict(block)
    block.conv.merge()
    base = tmp_path / "base"
    (base / "transformer").mkdir(parents=True)
    (base / "model_index.json").write_text(json.dumps({"transformer": ["diffusers", "X"]}))
    save_file(plain.state_dict(), base / "transformer" / "m.safetensors")
    fuse, why = stream_fuse.plan(base, _lora_file(tmp_path, state, {"transformer.r": 2, "transformer.lora_alpha": 4}),
                                 ["transformer"])
    assert fuse is not None, why
    (tmp_path / "out").mkdir()
    stream_fuse.fuse_to(base, tmp_path / "out", fuse)
    got = load_file(tmp_path / "out" / "transformer" / "m.safetensors")
    assert torch.allclose(got["conv.weight"], block.conv.base_layer.weight, atol=1e-6)
