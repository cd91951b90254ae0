"""A quantized frozen base (`train.base_model_precision`) under every adapter type (`train.lora_type`):
each combination that trains does, on tiny-sd, and one per family on the others; the denoiser's
Linear layers are quantized as they load; no quantized tensor reaches the output; what cannot
train is refused at config time, naming the key."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from finetune_runtime.adapters import apply_peft
from finetune_runtime.layout import PEFT_DIR, peft_components
from tasks.common.adapters import TYPES as ADAPTERS
from tasks.common.families import detect
from tasks.common.quantize import CHOICES, UNSUPPORTED_ADAPTERS, BasePrecision, is_quantized
from tasks.train.config import TrainConfig
from tasks.train.core import train
from tests.train.test_methods import cfg

SEQ = 32
PRECISIONS = [c for c in CHOICES if c != "none"]


def _trains(precision: str, adapter: str) -> bool:
    base = BasePrecision.parse(precision)
    return adapter not in UNSUPPORTED_ADAPTERS.get((base.precision, base.library), set())


def _train(tmp_path: Path, base: Path, data: Path, precision: str, adapter: str, **kw) -> tuple[list[float], Path]:
    out = tmp_path / "out"
    extra = {} if detect(base).name in ("sd", "sdxl") else {"max_sequence_length": SEQ}
    config = cfg(tmp_path, method="lora", lora_type=adapter, base_model_precision=precision, max_train_steps=2,
                 mixed_precision="bf16", learning_rate=1e-3, **extra, **kw)
    outcome = train(config, base, data, None, out)
    losses = [h.loss for h in outcome.history]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses), losses
    return losses, out


QUANTIZED_DTYPES = {torch.int8, torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2}


def _no_quantized_tensor(out: Path) -> None:
    """No tensor the output holds is 8- or 4-bit (packed 4-bit is uint8); the adapters are float32."""
    files = list(out.rglob("*.safetensors"))
    assert files
    for file in files:
        for key, tensor in load_file(file).items():
            assert tensor.dtype not in QUANTIZED_DTYPES, (file, key, tensor.dtype)
            if "lora" in key or "lokr" in key or "hada" in key:
                assert tensor.dtype == torch.float32, (file, key, tensor.dtype)


def _adapters_change_the_denoiser(base: Path, out: Path, adapter: str) -> None:
    """The output loads with the family's pipeline (diffusers' LoRA loader for LoRA and DoRA, peft
    for LoKr and LoHa) and changes the denoiser's weights."""
    family = detect(base)
    pipe = family.pipeline.diffusers_class().from_pretrained(base)
    denoiser = family.denoiser.name
    before = {k: v.clone() for k, v in getattr(pipe, denoiser).state_dict().items()}
    if adapter in ("lora", "dora"):
        weights = load_file(out / "pytorch_lora_weights.safetensors")
        assert (adapter == "dora") == any("magnitude" in k or "dora_scale" in k for k in weights)
        pipe.load_lora_weights(out)
        pipe.fuse_lora()
        pipe.unload_lora_weights()
    else:
        assert peft_components(out / PEFT_DIR) and not (out / "pytorch_lora_weights.safetensors").exists()
        apply_peft(pipe, out / PEFT_DIR)
    after = getattr(pipe, denoiser).state_dict()
    assert after.keys() == before.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("adapter", ADAPTERS.names())
def test_each_precision_trains_each_adapter_type_on_tiny_sd(tmp_path, tiny_sd, one_image, precision, adapter) -> None:
    if not _trains(precision, adapter):
        with pytest.raises(ValueError, match=rf"base_model_precision: {precision}.*lora_type: {adapter}"):
            cfg(tmp_path, method="lora", lora_type=adapter, base_model_precision=precision)
        return
    _, out = _train(tmp_path, tiny_sd, one_image, precision, adapter, fuse_lora=False)
    _no_quantized_tensor(out)
    _adapters_change_the_denoiser(tiny_sd, out, adapter)


FAMILY_CASES = [("sdxl", "int8", "loha"), ("sd3", "fp8", "lokr"), ("flux", "int8", "dora"), ("flux2", "nf4", "lora")]


@pytest.mark.parametrize(("name", "precision", "adapter"), FAMILY_CASES, ids=[c[0] for c in FAMILY_CASES])
def test_each_family_trains_on_a_quantized_base_and_fuses(request, tmp_path, one_image, name, precision,
                                                          adapter) -> None:
    """With gradient checkpointing through the quantized layers; the fused output (fuse_lora: true)
    from the base's own files, equal to what export and evaluate fuse from the adapters
    (tasks/common/finetuned.py)."""
    from diffusers import DiffusionPipeline

    from tasks.common.finetuned import load_finetuned

    base = request.getfixturevalue(f"tiny_{name}")
    _, out = _train(tmp_path, base, one_image, precision, adapter, gradient_checkpointing=True)
    _no_quantized_tensor(out)
    fused = DiffusionPipeline.from_pretrained(out)
    denoiser = detect(base).denoiser.name
    adapters_only = tmp_path / "adapters"
    adapters_only.mkdir()
    for item in ("pytorch_lora_weights.safetensors", PEFT_DIR):
        if (out / item).exists():
            (adapters_only / item).symlink_to(out / item)
    applied, _, info = load_finetuned(adapters_only, base)
    assert info["method"] == "lora"
    want, got = getattr(fused, denoiser).state_dict(), getattr(applied, denoiser).state_dict()
    assert all(torch.allclose(want[k].float(), got[k].float(), atol=1e-6) for k in want)
    plain = getattr(type(fused).from_pretrained(base), denoiser).state_dict()
    assert any(not torch.equal(plain[k], want[k]) for k in want)


def test_the_denoiser_is_quantized_as_it_loads(tiny_flux, monkeypatch) -> None:
    """Every Linear layer quantized, chunk by chunk (a few tensors at a time), and the quantized
    model computes what the bf16 one does within int8's error."""
    from tasks.common import weights_load

    family = detect(tiny_flux)
    plain = family.denoiser.load(tiny_flux, torch.bfloat16)
    calls = []
    quantize = BasePrecision.parse("int8")
    original = BasePrecision.quantize
    monkeypatch.setattr(weights_load, "CHUNK", 8)
    monkeypatch.setattr(BasePrecision, "quantize", lambda self, *a: calls.append(original(self, *a)) or calls[-1])
    quantized = family.denoiser.load(tiny_flux, torch.bfloat16, quantize)
    linears = [n for n, m in plain.named_modules() if type(m) is torch.nn.Linear]
    assert linears and all(is_quantized(quantized.get_submodule(n).weight) for n in linears)
    assert len([c for c in calls if c]) > 1 and sum(calls) == len(linears)  # in several chunks
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, 16, plain.config.in_channels, generator=generator, dtype=torch.bfloat16)
    text = torch.randn(1, 8, plain.config.joint_attention_dim, generator=generator, dtype=torch.bfloat16)
    kw = dict(hidden_states=x, encoder_hidden_states=text,
              pooled_projections=torch.randn(1, plain.config.pooled_projection_dim, dtype=torch.bfloat16),
              timestep=torch.tensor([0.5]), img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(8, 3),
              guidance=torch.tensor([3.5]) if plain.config.guidance_embeds else None)
    with torch.no_grad():
        want, got = plain(**kw).sample.float(), quantized(**kw).sample.float()
    assert (got - want).norm() / want.norm() < 0.05


@pytest.mark.quick
@pytest.mark.parametrize(("settings", "message"), [
    ({"method": "full", "base_model_precision": "int8"}, "base_model_precision: int8: method full updates the base"),
    ({"method": "dreambooth", "base_model_precision": "nf4"}, "method dreambooth updates the base's own weights"),
    ({"method": "lora", "base_model_precision": "int4"}, "base_model_precision: 'int4' is not one of none, fp8"),
    ({"method": "lora", "base_model_precision": "int8-quanto", "lora_type": "dora"},
     "int8-quanto cannot train lora_type: dora .* use one of none, fp8, int8, nf4, fp8-torchao, int8-torchao, nf4-bnb"),
    ({"method": "lora", "base_model_precision": "nf4", "lora_type": "lokr"}, "nf4-bnb cannot train lora_type: lokr"),
    ({"method": "lora", "base_model_precision": "int8", "launcher": "xla"}, "XLA has none of the quantized kernels"),
    ({"method": "lora", "decompose_factor": 4}, "decompose_factor is set .* only .* lora_type: lokr"),
    ({"method": "lora", "lora_type": "loha", "lora_dropout": 0.1}, "lora_dropout is set .* LoKr and LoHa do not"),
    ({"method": "dreambooth", "lora_type": "dora"}, "lora_type is set .* only method: lora reads it"),
    ({"method": "textual_inversion", "placeholder_token": "<s>", "initializer_token": "toy",
      "text_encoder_precision": "int8"}, "text_encoder_precision: int8: textual_inversion trains an embedding"),
    ({"method": "lora", "train_text_encoder": True, "text_encoder_precision": "fp8"},
     "text_encoder_precision: fp8: train_text_encoder: true trains through the text encoder"),
    ({"method": "lora", "text_encoder_precision": "nf4"}, "precision: nf4: the text encoders take torchao"),
    ({"method": "lora", "text_encoder_precision": "fp8"}, "fp8: the text encoders take torchao's int8 only"),
    ({"method": "lora", "text_encoder_precision": "int8", "cache_text_encoder_outputs_to_disk": True},
     "int8: the disk text cache is keyed by the encoders' weights"),
    ({"method": "lora", "text_encoder_precision": "int2"}, "text_encoder_precision: 'int2' is not one of"),
])
def test_what_cannot_train_is_refused_naming_the_key(tmp_path, settings, message) -> None:
    with pytest.raises(ValueError, match=message):
        TrainConfig(checkpoints_dir=tmp_path / "ckpt", **settings)


@pytest.mark.quick
def test_a_missing_library_is_named_with_its_install(monkeypatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    assert "needs the bitsandbytes package (pip install bitsandbytes)" in BasePrecision.parse("nf4").problem()
    assert "has no kernels on xla" in BasePrecision.parse("int8").problem("xla")


def test_textual_inversion_trains_its_embedding_through_a_quantized_denoiser(tmp_path, tiny_sd, one_image) -> None:
    config = cfg(tmp_path, method="textual_inversion", placeholder_token="<sks>", initializer_token="toy",
                 base_model_precision="int8", max_train_steps=2, mixed_precision="bf16", learning_rate=5e-3)
    outcome = train(config, tiny_sd, one_image, None, tmp_path / "out")
    report = outcome.report()
    assert all(math.isfinite(h.loss) for h in outcome.history) and report["steps"] == 2
    assert report["base_model_precision"] == "int8-torchao" and report["quantized_layers"] > 0
    _no_quantized_tensor(tmp_path / "out")


def test_the_text_encoders_are_quantized_as_they_load_and_build_the_text_cache(
        tmp_path, tiny_flux, one_image, monkeypatch) -> None:
    from tasks.common.families.base import ModelFamily

    quantized = []
    real = ModelFamily.load_components.__func__

    def spy(cls, *args, **kwargs):
        components = real(cls, *args, **kwargs)
        quantized.extend(sum(1 for p in m.parameters() if is_quantized(p)) for m in components.text_encoders)
        return components

    monkeypatch.setattr(ModelFamily, "load_components", classmethod(spy))
    from tasks.common import weights_load

    monkeypatch.setattr(weights_load, "_whole", lambda *a: pytest.fail(f"{a[2]} was loaded whole, not by chunks"))
    config = cfg(tmp_path, method="lora", text_encoder_precision="int8", base_model_precision="int8",
                 max_train_steps=2, mixed_precision="bf16", max_sequence_length=SEQ)
    outcome = train(config, tiny_flux, one_image, None, tmp_path / "out")
    assert len(quantized) == 2 and all(n > 0 for n in quantized), quantized  # CLIP and T5
    report = outcome.report()
    assert report["text_encoder_precision"] == "int8-torchao"
    assert all(math.isfinite(h.loss) for h in outcome.history) and report["steps"] == 2
    _no_quantized_tensor(tmp_path / "out")
