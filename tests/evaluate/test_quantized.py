"""evaluate.base_model_precision: the fine-tune and the base generated on a denoiser quantized as it loads
(the train stage's frozen base), the LoRA unfused on top; fp32 runs keep their precision and protocol ids."""
from __future__ import annotations

import numpy as np
import pytest

from tasks.common.config import parse_section
from tasks.common.errors import UserError
from tasks.common.psnr import psnr_db
from tasks.common.quantize import following_train
from tasks.evaluate.config import EvaluateConfig
from tests.export.adapters import write_adapters
from tests.export.tiny_ov import bf16_unet_pipeline, tiny_pipeline, write_subject_images

#: The lowest per-image PSNR of int8 images against the fp32 ones of the same seeds: measured 63.2-63.8 dB
#: on the tiny SD (2 steps, 64 px), fine-tune and base alike; identical images would score 100 (the cap).
MIN_PSNR_DB = 45.0


def _config(**extra) -> EvaluateConfig:
    fields = dict(prompts=["a {identifier} {class_name}"], images_per_prompt=2, num_inference_steps=2,
                  drift={"enabled": False})
    return EvaluateConfig(**{**fields, **extra})


def _loaded(pipe) -> dict:
    """What the pipeline's denoiser holds: quantized weights, peft's LoRA layers."""
    from tasks.common.quantize import has_quantized

    lora = [n for n, _ in pipe.unet.named_modules() if n.endswith("lora_A")]
    return {"quantized": has_quantized(pipe.unet), "text_quantized": has_quantized(pipe.text_encoder),
            "lora_layers": len(lora), "dtype": str(pipe.vae.dtype)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The tiny SD base with a LoRA, evaluated in fp32 and in int8, each load's pipeline recorded."""
    from tasks.evaluate import core, phases

    base = tiny_pipeline(tmp_path_factory, "builtin:tiny-sd")
    root = tmp_path_factory.mktemp("quantized")
    lora = write_adapters(base, root / "lora", embeds=False)
    data = write_subject_images(root / "data")
    seen: list[tuple[str, dict]] = []

    def recording(name, load):
        def wrapper(*a, **kw):
            loaded = load(*a, **kw)
            seen.append((name, _loaded(loaded[0] if isinstance(loaded, tuple) else loaded)))
            return loaded
        return wrapper

    mp = pytest.MonkeyPatch()
    mp.setattr(phases, "load_finetuned", recording("finetuned", phases.load_finetuned))
    mp.setattr(phases, "load_base", recording("base", phases.load_base))
    try:
        out = {p: core.evaluate(lora, base, data, _config(base_model_precision=p, base_cache_dir=str(root / "cache")))
               for p in ("none", "int8")}
    finally:
        mp.undo()
    return {**out, "seen": seen, "base": base, "cache": root / "cache"}


def test_an_int8_evaluation_generates_both_models_on_a_quantized_denoiser(runs):
    fp32, int8 = (s for _, s in runs["seen"][:2]), runs["seen"][2:]
    assert [n for n, _ in runs["seen"]] == ["finetuned", "base", "finetuned", "base"]
    for seen in fp32:
        assert not seen["quantized"] and seen["lora_layers"] == 0  # fused, as before
    (_, tuned), (_, base) = int8
    assert tuned["quantized"] and base["quantized"]  # the Linear layers' weights are torchao's int8
    assert not tuned["text_quantized"] and tuned["dtype"] == "torch.float32"  # the tiny SD is stored fp32
    assert tuned["lora_layers"] > 0 and base["lora_layers"] == 0  # unfused peft layers on the fine-tune only
    report = runs["int8"].report
    assert report["generation"]["precision"] == {"all": "f32", "denoiser": "int8-torchao"}
    assert report["protocol"]["settings"]["precision"] == report["generation"]["precision"]
    assert runs["none"].report["generation"]["precision"] == {"all": "f32"}


def test_the_int8_images_are_close_to_the_fp32_ones_but_not_the_same(runs):
    for attr in ("images", "base_images"):
        exact = [np.asarray(im, dtype=np.float64) / 255 for row in getattr(runs["none"], attr) for im in row]
        held = [np.asarray(im, dtype=np.float64) / 255 for row in getattr(runs["int8"], attr) for im in row]
        psnrs = [psnr_db(a, b) for a, b in zip(exact, held)]
        assert len(psnrs) == 2 and all(MIN_PSNR_DB < p < 100 for p in psnrs), (attr, psnrs)


def test_the_protocol_id_follows_the_precision_and_nothing_else(runs):
    from tasks.evaluate.protocol import describe

    none, int8 = runs["none"].report["protocol"], runs["int8"].report["protocol"]
    assert none["id"] != int8["id"]
    differ = {k for k in none["settings"] if none["settings"][k] != int8["settings"][k]}
    assert differ == {"precision"}
    settings = dict(none["settings"])  # an fp32 run's id is what it was before the setting existed
    args = dict(prompts=settings["prompts"], clip_texts=settings["clip_t_texts"], backend="pytorch",
                shape=settings["shape"], instance=settings["instance_images"], heldout=None, base_backend="pytorch")
    assert describe(_config(), precision={"all": "f32"}, **args)["id"] == none["id"]


def test_null_follows_the_train_stage_and_a_bad_value_names_the_key():
    params = {"train": {"base_model_precision": "nf4"}}
    assert following_train("evaluate", _config(), params).base_model_precision == "nf4"
    assert following_train("evaluate", _config(base_model_precision="none"),
                           params).base_model_precision == "none"
    assert following_train("evaluate", _config(), {}).base_model_precision == "none"
    with pytest.raises(UserError, match=r"evaluate.base_model_precision is null, so it follows "
                                        r"train.base_model_precision: 'int4' is not one of"):
        following_train("evaluate", _config(), {"train": {"base_model_precision": "int4"}})
    with pytest.raises(UserError, match=r"evaluate: Value error, base_model_precision: 'int4' is not one of"):
        parse_section("evaluate", {"prompts": ["a {class_name}"], "base_model_precision": "int4"}, EvaluateConfig)


def test_the_base_cache_keeps_each_precision_apart(runs):
    import json

    entries = [p for p in runs["cache"].iterdir() if not p.name.startswith(".")]
    precisions = sorted(json.loads((e / "manifest.json").read_text())["settings"]["precision"].get("denoiser", "-")
                        for e in entries)
    assert precisions == ["-", "int8-torchao"]
    assert runs["int8"].report["generation"]["base_cache"] == "miss"


def test_a_full_fine_tune_has_its_own_denoiser_quantized(runs, tmp_path):
    import torch

    from tasks.common.families import build_tiny_pipeline
    from tasks.common.finetuned import load_finetuned
    from tasks.common.quantize import BasePrecision, has_quantized

    tune = build_tiny_pipeline("builtin:tiny-sd", 1, tmp_path / "tune")
    pipe, kind, info = load_finetuned(tune, None, quantize=BasePrecision.parse("int8"), dtype=torch.float32)
    assert kind.full_pipeline and info == {"method": "full_pipeline"}
    assert has_quantized(pipe.unet) and not has_quantized(pipe.vae)


def test_a_bf16_stored_base_is_generated_in_bf16_only_on_a_cpu_that_computes_it(tmp_path_factory, tmp_path,
                                                                                monkeypatch) -> None:
    """With a quantized denoiser the rest of the pipeline computes in bf16 where the base is stored in
    bf16 and the CPU has native bf16, in fp32 on an AVX2-only one (flags faked both ways); the
    precision is part of the protocol and the base cache's key."""
    import torch

    from tasks.evaluate.phases import Precision

    src = bf16_unet_pipeline(tmp_path_factory, tmp_path / "bf16-base")
    monkeypatch.setenv("FINETUNE_CPU_FLAGS", "avx2 avx512f avx512_bf16 amx_bf16")
    native = Precision.of(_config(base_model_precision="int8"), src, None)
    assert native.dtype == torch.bfloat16 and native.describe() == {"all": "bf16", "denoiser": "int8-torchao"}
    monkeypatch.setenv("FINETUNE_CPU_FLAGS", "avx avx2 fma")
    emulated = Precision.of(_config(base_model_precision="int8"), src, None)
    assert emulated.dtype == torch.float32 and emulated.describe() == {"all": "f32", "denoiser": "int8-torchao"}
    assert Precision.of(_config(), src, None).describe() == {"all": "f32"}, "no quantized denoiser: fp32 as before"
