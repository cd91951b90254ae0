"""export.adapters: runtime: two LoRA fine-tunes of one tiny-sd base on one base export, applied by
OpenVINO GenAI at run time (real optimum-intel export, real GenAI pipeline, real diffusers)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

from tasks.common.genai import ADAPTER_FILE, BASE_DIR, GENAI_LORA_NAME, GenAIRunner, is_runtime_export
from tasks.common.openvino_model import StaticShape
from tasks.common.outputs import OUTPUT_MARKER
from tasks.common.psnr import psnr_db
from tasks.export.config import ExportConfig
from tests.export.adapters import lora_images, write_adapters
from tests.export.tiny_ov import PARITY_FAST, runtime_export, tiny_pipeline

SHAPE = StaticShape(1, 64, 64, 2)
CALL = dict(num_inference_steps=2, guidance_scale=7.5)


def _config(tmp, **extra) -> ExportConfig:
    return ExportConfig(adapters="runtime", num_images_per_prompt=SHAPE.num_images_per_prompt,
                        parity=PARITY_FAST, base_cache_dir=str(tmp / "base-cache"), **extra)


@pytest.fixture(scope="module")
def two_fine_tunes(tmp_path_factory):
    """(base, {name: (lora folder, runtime export, report)}): `a` a UNet LoRA, `b` UNet + text
    encoder; the session's first export converts the base, the next take it from the cache."""
    base = tiny_pipeline(tmp_path_factory, "builtin:tiny-sd")
    return base, {name: runtime_export(tmp_path_factory, name, seed, text)
                  for name, seed, text in (("a", 1, False), ("b", 2, True))}


def test_both_fine_tunes_share_one_base_export_and_pass_parity(two_fine_tunes):
    _, runs = two_fine_tunes
    (_, a_dir, a), (_, b_dir, b) = runs["a"], runs["b"]
    assert [a["base_export"]["cache_hit"], b["base_export"]["cache_hit"]] == [False, True]
    assert a["base_export"]["base_fingerprint"] == b["base_export"]["base_fingerprint"]
    for report in (a, b):
        assert report["parity"]["passed"] and report["parity"]["image_psnr_db"] >= 30
        assert report["size_mb"]["adapter"] < 0.05 * report["size_mb"]["base"]
    # b's base is a's, file for file (hard links into the cache where the filesystem allows)
    files = sorted(p.relative_to(a_dir / BASE_DIR) for p in (a_dir / BASE_DIR).rglob("*") if p.is_file())
    assert files and all((a_dir / BASE_DIR / f).read_bytes() == (b_dir / BASE_DIR / f).read_bytes()
                         for f in files)
    assert (a_dir / BASE_DIR / "tokenizer" / "openvino_tokenizer.xml").is_file()
    info = json.loads((b_dir / ADAPTER_FILE).read_text())
    assert info["lora_layers"] > 0 and info["static_shape"] == SHAPE.as_dict() and is_runtime_export(b_dir)


def test_one_compiled_base_switches_and_blends_adapters_per_call(two_fine_tunes):
    """Each adapter reproduces its own fine-tune, none reproduces the base, and 0.5/0.5 reproduces
    diffusers' blend of the two; all from one compiled pipeline, in any order."""
    import torch

    from tasks.evaluate.generate import initial_latents

    base, runs = two_fine_tunes
    a_lora, b_lora = runs["a"][0], runs["b"][0]
    files = {name: runs[name][1] / GENAI_LORA_NAME for name in runs}
    runner = GenAIRunner(runs["a"][1] / BASE_DIR, SHAPE, CALL["guidance_scale"], "f32",
                         [(files["a"], 0.0), (files["b"], 0.0)])
    one = initial_latents([0], runner, 64, 64).shape[1:]  # the runner passes for a diffusers pipeline
    latents = torch.randn((2, *one), generator=torch.Generator().manual_seed(0))  # what diffusers draws
    wanted = {"a": ([a_lora], [1.0]), "b": ([b_lora], [1.0]), "blend": ([a_lora, b_lora], [0.5, 0.5]),
              "base": ([], [])}
    weights = {"a": (1.0, 0.0), "b": (0.0, 1.0), "blend": (0.5, 0.5), "base": (0.0, 0.0)}
    got = {}
    for name in ("a", "base", "blend", "b", "a"):
        runner.adapters = [(adapter, w) for (adapter, _), w in zip(runner.adapters, weights[name])]
        got[name] = runner(prompt=["a photo of sks toy"], latents=latents, output_type="np", **CALL).images
    refs = {name: lora_images(base, loras, w, 0, CALL["num_inference_steps"], images=2)
            for name, (loras, w) in wanted.items()}
    for name, images in got.items():  # nearest its own PyTorch twin, by a margin (the LoRAs are small)
        own = psnr_db(refs[name], images)
        nearest_other = max(psnr_db(ref, images) for other, ref in refs.items() if other != name)
        assert own >= 30 and own > nearest_other + 3, (name, own, nearest_other)


def test_the_evaluate_stage_generates_through_the_runtime_export(two_fine_tunes):
    """evaluate's export-fidelity images come from GenAI (base + adapter) and match PyTorch."""
    from tasks.common.finetuned import load_finetuned
    from tasks.evaluate.config import EvaluateConfig
    from tasks.evaluate.generate import generate
    from tasks.evaluate.phases import export_images

    base, runs = two_fine_tunes
    lora, export_dir, _ = runs["b"]
    cfg = EvaluateConfig(prompt_set="object", num_inference_steps=2, images_per_prompt=3)
    made = export_images(export_dir, ["a photo of sks toy", "sks toy on a beach"], cfg)
    assert made["backend"] == "openvino-genai-adapter" and made["shape"] == SHAPE
    pipe, _, _ = load_finetuned(lora, base)
    ref, _ = generate(pipe, ["a photo of sks toy", "sks toy on a beach"], SHAPE, 3, cfg.seed, 2,
                      cfg.guidance_scale, desc="reference")
    assert [len(row) for row in made["images"]] == [3, 3]
    pairs = [(np.asarray(x, np.float32) / 255, np.asarray(y, np.float32) / 255)
             for row_x, row_y in zip(made["images"], ref) for x, y in zip(row_x, row_y)]
    assert min(psnr_db(x, y) for x, y in pairs) >= 30


def test_an_int8_weight_base_serves_the_same_adapter(two_fine_tunes, tmp_path):
    """compression.mode int8: the f32 base + adapter passes parity against PyTorch, then the int8
    base + adapter is gated against it; the compressed base is cached beside the f32 one."""
    from tasks.export.runtime import export_runtime

    base, runs = two_fine_tunes
    lora, f32_dir, f32_report = runs["b"]
    cfg = ExportConfig(adapters="runtime", num_images_per_prompt=SHAPE.num_images_per_prompt, parity=PARITY_FAST,
                       base_cache_dir=str(f32_dir.parent / "base-cache"),
                       compression={"mode": "int8", "min_psnr_db": 30})
    reports = []
    for run in ("first", "second"):
        (tmp_path / run).mkdir()
        reports.append(export_runtime(lora, tmp_path / run, cfg, base))
    first, second = reports
    assert first["base_export"]["cache_hit"], "the f32 base comes from the session's cache"
    assert [first["compression"]["cache_hit"], second["compression"]["cache_hit"]] == [False, True]
    comp = first["compression"]
    assert first["parity"]["passed"] and comp["passed"] and comp["psnr_vs_openvino_fp32_db"] >= 30, comp
    out = tmp_path / "first"
    assert sorted(p.name for p in out.iterdir()) == sorted([BASE_DIR, GENAI_LORA_NAME, ADAPTER_FILE,
                                                            "openvino_runtime.json"])  # no scratch left
    unet = "unet/openvino_model"
    assert 'element_type="u8"' in (out / BASE_DIR / f"{unet}.xml").read_text()
    assert (out / BASE_DIR / f"{unet}.bin").stat().st_size < 0.4 * (f32_dir / BASE_DIR / f"{unet}.bin").stat().st_size
    f32_key = json.loads((f32_dir / ADAPTER_FILE).read_text())["base_key"]
    served = json.loads((out / ADAPTER_FILE).read_text())["base_key"]
    assert served.startswith(f"{f32_key}-int8-asym-nncf") and first["base_export"]["served_key"] == served
    assert f32_report["base_export"]["key"] == f32_key == first["base_export"]["key"]
    assert first["size_mb"]["openvino"] < first["size_mb"]["base"] + 1, "no f32 scratch copy is counted"


def test_runtime_refuses_what_genai_cannot_apply(tmp_path_factory, tmp_path):
    from tasks.common.config import parse_section
    from tasks.common.errors import UserError
    from tasks.export.runtime import export_runtime

    base = tiny_pipeline(tmp_path_factory, "builtin:tiny-sd")
    for bad, key in (({"batch_size": 2}, "export.batch_size"),
                     ({"inference_precision": "bf16"}, "export.inference_precision"),
                     ({"compression": {"mode": "int4"}}, "export.compression.mode")):
        with pytest.raises(UserError, match=key):
            parse_section("export", {"adapters": "runtime", **bad}, ExportConfig)
    embeds = write_adapters(base, tmp_path / "ti", lora=False)
    with pytest.raises(UserError, match="textual-inversion"):
        export_runtime(embeds, tmp_path / "out", _config(tmp_path), base)
    with pytest.raises(UserError, match="holds no pytorch_lora_weights"):
        export_runtime(base, tmp_path / "out", _config(tmp_path), base)
    lora = write_adapters(base, tmp_path / "lora", embeds=False)
    with pytest.raises(UserError, match="needs --base"):
        export_runtime(lora, tmp_path / "out", _config(tmp_path), None)
    assert not (tmp_path / "out").exists()


def test_cli_writes_the_runtime_layout(two_fine_tunes, tmp_path, monkeypatch, capsys):
    """The stage's CLI with export.adapters: runtime: base/, the adapter, and its report."""
    from tests.export.test_export import _run_cli

    base, runs = two_fine_tunes
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"export": {
        "adapters": "runtime", "parity": PARITY_FAST,
        "base_cache_dir": str(runs["a"][1].parent / "base-cache")}}))  # the session's: a cache hit
    out, report = tmp_path / "models" / "openvino", tmp_path / "export.json"
    code = _run_cli(monkeypatch, capsys, "--model", str(runs["a"][0]), "--base", str(base),
                    "--out", str(out), "--report", str(report), "--params", str(params))
    assert code == 0, capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [BASE_DIR, GENAI_LORA_NAME, ADAPTER_FILE, "openvino_runtime.json", OUTPUT_MARKER])
    assert json.loads(report.read_text())["adapters"] == "runtime"


def test_an_sdxl_lora_on_both_text_encoders_matches_through_genai(tmp_path_factory, tmp_path):
    """SDXL's keys (lora_unet, lora_te1, lora_te2) are the ones GenAI applies: the run-time
    adapter reproduces the PyTorch fine-tune."""
    import torch
    from diffusers import StableDiffusionXLPipeline
    from peft import LoraConfig

    from tasks.common.genai import generate, load_text2image, write_genai_lora
    from tasks.export.runtime import base_export

    base = tiny_pipeline(tmp_path_factory, "builtin:tiny-sdxl")
    pipe = StableDiffusionXLPipeline.from_pretrained(base)
    pipe.set_progress_bar_config(disable=True)
    generator = torch.Generator().manual_seed(3)
    pipe.unet.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    for name in ("text_encoder", "text_encoder_2"):
        getattr(pipe, name).add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for model in (pipe.unet, pipe.text_encoder, pipe.text_encoder_2):
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    layers = write_genai_lora(pipe, tmp_path / GENAI_LORA_NAME)
    ref = pipe("a photo of sks toy", num_images_per_prompt=2, height=64, width=64, output_type="np",
               generator=torch.Generator().manual_seed(0), **CALL).images
    pipe.disable_lora()
    plain = pipe("a photo of sks toy", num_images_per_prompt=2, height=64, width=64, output_type="np",
                 generator=torch.Generator().manual_seed(0), **CALL).images
    del pipe
    base_export(base, tmp_path / BASE_DIR, None)
    runner = load_text2image(tmp_path / BASE_DIR, SHAPE, CALL["guidance_scale"], "f32",
                             [tmp_path / GENAI_LORA_NAME])
    import openvino_genai

    got = generate(runner, "a photo of sks toy", SHAPE, CALL["num_inference_steps"], CALL["guidance_scale"], 0,
                   [(openvino_genai.Adapter(str(tmp_path / GENAI_LORA_NAME)), 1.0)])
    assert layers > 0 and psnr_db(ref, got) >= 30 and psnr_db(ref, got) > psnr_db(plain, got) + 3


def test_an_sd3_transformer_lora_matches_through_genai_and_text_layers_are_refused(tmp_path_factory, tmp_path):
    """SD3: GenAI applies the transformer's LoRA under the `transformer` prefix (the adapter's
    images are the PyTorch fine-tune's, not the base's); a file with CLIP layers, which GenAI
    leaves unapplied, is refused before anything is written."""
    import openvino_genai
    import torch
    from diffusers import StableDiffusion3Pipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    from tasks.common.errors import UserError
    from tasks.common.genai import generate, load_text2image, write_genai_lora
    from tasks.export.runtime import base_export, export_runtime

    base = tiny_pipeline(tmp_path_factory, "builtin:tiny-sd3")
    pipe = StableDiffusion3Pipeline.from_pretrained(base)
    pipe.set_progress_bar_config(disable=True)
    generator = torch.Generator().manual_seed(3)
    pipe.transformer.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    with torch.no_grad():
        for name, param in pipe.transformer.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    layers = write_genai_lora(pipe, tmp_path / GENAI_LORA_NAME)
    call = dict(num_inference_steps=2, guidance_scale=5.0)
    images = {}
    for name in ("fine-tune", "base"):
        images[name] = pipe("a photo of sks toy", num_images_per_prompt=2, height=64, width=64, output_type="np",
                            generator=torch.Generator().manual_seed(0), **call).images
        pipe.disable_lora()
    pipe.enable_lora()
    pipe.text_encoder.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=["q_proj", "v_proj"]))
    StableDiffusion3Pipeline.save_lora_weights(
        tmp_path / "with-text", transformer_lora_layers=get_peft_model_state_dict(pipe.transformer),
        text_encoder_lora_layers=get_peft_model_state_dict(pipe.text_encoder),
        weight_name="pytorch_lora_weights.safetensors", safe_serialization=True)
    del pipe
    with pytest.raises(UserError, match="layers for text_encoder, which OpenVINO GenAI does not apply"):
        export_runtime(tmp_path / "with-text", tmp_path / "out", _config(tmp_path), base)
    assert not (tmp_path / "out").exists()
    base_export(base, tmp_path / BASE_DIR, None)
    runner = load_text2image(tmp_path / BASE_DIR, SHAPE, call["guidance_scale"], "f32", [tmp_path / GENAI_LORA_NAME])
    got = generate(runner, "a photo of sks toy", SHAPE, call["num_inference_steps"], call["guidance_scale"], 0,
                   [(openvino_genai.Adapter(str(tmp_path / GENAI_LORA_NAME)), 1.0)])
    own, plain = psnr_db(images["fine-tune"], got), psnr_db(images["base"], got)
    assert layers > 0 and own >= 30 and own > plain + 3, (own, plain)
