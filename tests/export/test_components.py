"""`export.components: one_at_a_time`: each model loaded, converted, checked and written alone.

tiny-sd (against the default whole-pipeline export of the session) and tiny-flux2 (int8 weights
compressed per component) are each exported once per module; a conversion broken on purpose
must fail the per-component gate and leave no model behind.
"""
from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import yaml

from tasks.common.psnr import psnr_db
from tests.export.tiny_ov import PARITY_FAST, bf16_unet_pipeline, exported, tiny_pipeline

ONE = {"components": "one_at_a_time", "parity": PARITY_FAST}


def _export(tmp_path_factory, kind: str, **extra):
    from tasks.export.components import export_components
    from tasks.export.config import ExportConfig

    src = tiny_pipeline(tmp_path_factory, kind)
    out = tmp_path_factory.mktemp("components") / "openvino"
    return src, out, export_components(src, out, ExportConfig(**ONE, **extra))


@pytest.fixture(scope="module")
def sd_components(tmp_path_factory):
    return _export(tmp_path_factory, "builtin:tiny-sd")


@pytest.fixture(scope="module")
def flux2_int8(tmp_path_factory):
    return _export(tmp_path_factory, "builtin:tiny-flux2", compression={"mode": "int8"})


def _images(path, seed=3):
    """One 64 px image of the export at `path`, from seeded latents."""
    import torch

    from tasks.common import families
    from tasks.common.openvino_model import load_ov_pipeline

    pipe = load_ov_pipeline(path, static=True, precision="f32")
    pipe.set_progress_bar_config(disable=True)
    family = families.of_pipeline(pipe)
    shape = family.denoiser.latent_shape(pipe, 64, 64)
    latents = torch.randn((1, *shape), generator=torch.Generator().manual_seed(seed))
    return np.asarray(family.generate(pipe, ["a photo of sks toy"], steps=2, latents=latents, height=64,
                                      width=64, guidance=7.5, output_type="np"))


def _check_parity_section(report, names, max_rel):
    parity = report["parity"]
    assert parity["passed"] and parity["failed_components"] == []
    assert set(parity["components"]) == set(names)
    for name in names:
        entry = parity["components"][name]
        assert entry["passed"] and entry["finite"] and entry["max_rel"] < max_rel, (name, entry)
        assert entry["peak_rss_mb"] > 0
    assert parity["pipeline_image"]["passed"]


def test_sd_one_at_a_time_matches_the_whole_export(sd_components, tmp_path_factory):
    """Same images as the default path's export, per-component parity and peaks in the report."""
    from tasks.common import families
    from tasks.common.families.sd import StableDiffusion

    src, out, report = sd_components
    assert report["components_mode"] == "one_at_a_time" and report["pipeline_class"] == "OVStableDiffusionPipeline"
    names = [*families.ov_component_names(StableDiffusion), "vae_encoder"]
    _check_parity_section(report, names, max_rel=1e-4)  # fp32: ~1e-6
    assert report["parity"]["image_psnr_db"] >= 30.0
    assert set(report["memory_peak_mb"]) >= {"text_encoder", "unet", "vae", "reshape_save"}
    _, whole, _ = exported(tmp_path_factory, "builtin:tiny-sd")
    ours, theirs = _images(out), _images(whole)
    assert ours.shape == (1, 64, 64, 3)
    assert psnr_db(theirs, ours) > 60.0  # the same IR up to node names


def test_openvino_genai_loads_a_one_at_a_time_export_and_makes_its_images(sd_components):
    """OpenVINO GenAI's Text2ImagePipeline (SD 1.x/2.x, SDXL, SD3, FLUX.1) reads the folder as written,
    tokenizers included, and starts from the latents diffusers draws for the same seed: same image as
    optimum-intel's pipeline (f32, 64 px, 2 steps)."""
    import openvino_genai as genai

    from tasks.common.openvino_model import StaticShape

    _, out, _ = sd_components
    pipe = genai.Text2ImagePipeline(str(out))
    pipe.reshape(1, 64, 64, 7.5)
    pipe.compile("CPU", INFERENCE_PRECISION_HINT="f32")
    from tasks.common.genai import genai_call

    theirs = genai_call(pipe, "a photo of sks toy", StaticShape(1, 64, 64, 1), 2, 7.5, genai.TorchGenerator(3), [])
    ours = (_images(out) * 255).round()
    assert theirs.shape == (1, 64, 64, 3)
    assert psnr_db(theirs.astype(np.float32) / 255, ours / 255) > 30


def test_flux2_int8_per_component(flux2_int8):
    """A transformer family: loads in OVFlux2KleinPipeline, each model's weights compressed as it
    was written (smaller files), the compressed error recorded beside the conversion's."""
    from tasks.common import families
    from tasks.common.families.flux2 import Flux2Klein

    src, out, report = flux2_int8
    assert report["pipeline_class"] == "OVFlux2KleinPipeline"
    names = [*families.ov_component_names(Flux2Klein), "vae_encoder"]
    _check_parity_section(report, names, max_rel=1e-4)
    for name in names:
        comp = report["parity"]["components"][name]["compression"]
        assert comp["bin_mb_after"] < comp["bin_mb_before"], name
        assert comp["max_rel"] < 0.1, name
    vae = report["parity"]["components"]["vae_decoder"]["compression"]
    assert vae["bin_mb_after"] < vae["bin_mb_before"] / 2  # convolutions: int8 is ~4x smaller
    assert report["compression"]["mode"] == "int8"
    images = _images(out)
    assert images.shape == (1, 64, 64, 3) and np.isfinite(images).all()


def test_a_broken_conversion_fails_the_gate_and_writes_nothing(tmp_path_factory, tmp_path, monkeypatch, capsys):
    """The UNet's weights perturbed after its PyTorch reference ran, before it is converted (a
    conversion that writes wrong weights): the stage fails, names it, and publishes no folder."""
    import torch

    from tasks.export import components

    real = components._convert

    def broken(models, out, patch_16bit):
        if "unet" in models:
            with torch.no_grad():
                for param in models["unet"][0].parameters():
                    param.add_(torch.randn_like(param) * 0.05)
        real(models, out, patch_16bit)

    monkeypatch.setattr(components, "_convert", broken)
    src = tiny_pipeline(tmp_path_factory, "builtin:tiny-sd")
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"export": ONE}))
    out, report = tmp_path / "models" / "openvino", tmp_path / "reports" / "export.json"
    from tasks.export.__main__ import main

    monkeypatch.setattr(sys, "argv", ["python -m tasks.export", "--model", str(src), "--out", str(out),
                                      "--report", str(report), "--params", str(params)])
    with pytest.raises(SystemExit) as exc:
        main()
    assert exc.value.code == 2
    assert "parity check failed for unet" in capsys.readouterr().err
    assert not out.exists() and not list(out.parent.iterdir())
    parity = json.loads(report.read_text())["parity"]
    assert parity["passed"] is False and parity["failed_components"] == ["unet"]
    assert parity["components"]["unet"]["max_rel"] > parity["component_max_rel"]
    assert parity["components"]["text_encoder"]["passed"]
    assert "vae_decoder" not in parity["components"]  # stopped at the first failure


def test_components_load_in_their_stored_dtype(tmp_path_factory):
    """A bf16 release: the component converted is loaded in bf16, the others are meta (no weights)."""
    import torch
    from diffusers import DiffusionPipeline

    from tasks.common import families
    from tasks.export.components import load_for

    src = tiny_pipeline(tmp_path_factory, "builtin:tiny-sd")
    bf16 = tmp_path_factory.mktemp("bf16") / "pipe"
    DiffusionPipeline.from_pretrained(src, torch_dtype=torch.bfloat16).save_pretrained(bf16)
    dtypes = families.stored_dtypes(bf16)
    assert dtypes["unet"] == torch.bfloat16
    pipe = load_for(bf16, families.read_index(bf16), "unet", dtypes)
    assert pipe.unet.dtype == torch.bfloat16 and pipe.unet.device.type == "cpu"
    assert pipe.vae.device.type == "cpu"
    assert pipe.text_encoder.device.type == "meta"


@pytest.mark.parametrize(("key", "value"), [("compression", {"mode": "hybrid"}), ("single_file", "fp16"),
                                            ("adapters", "runtime")])
def test_options_the_mode_refuses_name_the_key(key, value):
    from pydantic import ValidationError

    from tasks.export.config import ExportConfig

    with pytest.raises(ValidationError, match=f"one_at_a_time does not take this export.{key}"):
        ExportConfig(**{**ONE, key: value})


def test_a_lora_streams_into_the_base(tmp_path_factory, tmp_path):
    """A LoRA-only train output is fused into the base's shards (no whole pipeline in memory); the
    fused weights are what the in-memory fuse of the default path gives."""
    import torch
    from safetensors.torch import load_file

    from tasks.common.finetuned import load_finetuned
    from tasks.export.components import streamed_source
    from tests.export.adapters import write_adapters

    base = tiny_pipeline(tmp_path_factory, "builtin:tiny-sd")
    lora = write_adapters(base, tmp_path / "lora", embeds=False)
    source, info = streamed_source(lora, base, tmp_path)
    assert info["method"] == "lora" and info["streamed_fuse"]["unet"] > 0
    streamed = load_file(next((source / "unet").glob("*.safetensors")))
    in_memory = load_finetuned(lora, base)[0].unet.state_dict()
    name = next(k for k in streamed if "attn1.to_q.weight" in k)
    assert torch.allclose(streamed[name], in_memory[name], atol=1e-6)
    assert not torch.equal(streamed[name], load_file(next((base / "unet").glob("*.safetensors")))[name])
    assert streamed_source(base, None, tmp_path) is None  # a full pipeline: exported as it is


def test_a_streamed_fuse_without_the_disk_for_it_is_refused_before_writing(tmp_path_factory, tmp_path, monkeypatch):
    """The fused copy of the LoRA's components (FLUX.1-dev: the 22 GB transformer) goes to TMPDIR: with
    less free disk there, refused naming the size, the folder and TMPDIR, before any file is written."""
    from collections import namedtuple

    from tasks.common.errors import UserError
    from tasks.export import components
    from tests.export.adapters import write_adapters

    base = tiny_pipeline(tmp_path_factory, "builtin:tiny-sd")
    lora = write_adapters(base, tmp_path / "lora", embeds=False)
    work = tmp_path / "work"
    work.mkdir()
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(components.shutil, "disk_usage", lambda path: usage(1, 1, 1000))
    with pytest.raises(UserError, match=r"fusing the LoRA into unet writes 0\.0 GB into the temporary folder .* where "
                                        r"0\.0 GB is free: free disk there or point TMPDIR at"):
        components.streamed_source(lora, base, work)
    assert list(work.iterdir()) == []


def test_int4_compresses_an_ir_in_place(sd_components, tmp_path):
    """int4 on a written IR: 4-bit groups where `group_size` divides a layer, adjusted where not
    (tiny-sd's widths would stop NNCF's default), the files ~4x smaller, the IR still runs."""
    import shutil

    import openvino as ov

    from tasks.export import component_check as check
    from tasks.export.config import CompressionConfig

    _, out, _ = sd_components
    folder = tmp_path / "unet"
    shutil.copytree(out / "unet", folder)
    sizes = check.compress_ir(folder / "openvino_model.xml", CompressionConfig(mode="int4", group_size=16, ratio=0.8))
    assert sizes["bin_mb_after"] < sizes["bin_mb_before"] / 3
    model = ov.Core().read_model(folder / "openvino_model.xml")
    kinds = {op.get_output_element_type(0).get_type_name() for op in model.get_ops()
             if op.get_type_name() == "Constant"}
    assert {"u4", "u8"} <= kinds or {"i4", "i8"} <= kinds  # 4-bit groups and the 8-bit backup


def test_a_model_over_the_available_memory_is_refused_before_anything_loads(tmp_path_factory, tmp_path, monkeypatch):
    """Its stored weights alone exceed the memory available: refused naming the model, its size and
    what converting it takes, before any model loads; the report of an export that fits has each
    group's weights."""
    from tasks.common.errors import UserError
    from tasks.export import components
    from tasks.export.config import ExportConfig

    src = tiny_pipeline(tmp_path_factory, "builtin:tiny-sd")
    weights = components.preflight(src)
    assert set(weights) == {"text_encoder", "unet", "vae"} and all(v >= 0 for v in weights.values())
    largest = max(weights, key=weights.get)
    need = sum(p.stat().st_size for p in (src / largest).rglob("*.safetensors"))
    monkeypatch.setattr(components, "available_bytes", lambda: need - 1)
    monkeypatch.setattr(components, "load_for", lambda *a: pytest.fail("a model was loaded"))
    out = tmp_path / "openvino"
    with pytest.raises(UserError, match=rf"one_at_a_time: {largest} holds 0\.0 GB of weights in its stored dtype; "
                                        r"0\.0 GB of memory is available and converting it takes about") as info:
        components.export_components(src, out, ExportConfig(**ONE))
    assert "or set export.enabled: false to evaluate and register the PyTorch fine-tune" in str(info.value)
    # weights that fit beside the least measured conversion ratio are not refused, only warned about
    monkeypatch.setattr(components, "available_bytes", lambda: int(components.PHASE_PER_WEIGHT_MIN * need) + 1)
    assert components.preflight(src) == weights
    assert not out.exists()


def test_a_skipped_export_writes_only_its_note_and_nothing_downstream_reads_it_as_an_export(tmp_path, monkeypatch):
    """export.enabled: false: the folder holds the note, the report says why, no model loads; evaluate
    and registration then see no export (export_or_none), and the preflight's refusal names the setting."""
    import json

    from tasks.common.openvino_model import SKIPPED_FILE, export_or_none
    from tasks.common.outputs import OUTPUT_MARKER
    from tasks.export.__main__ import skip
    from tasks.export.config import ExportConfig
    from tasks.register.model_contents import model_artifacts

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    out, report = tmp_path / "models/openvino", tmp_path / "reports/export.json"
    skip(out, report, ExportConfig(enabled=False))
    assert sorted(p.name for p in out.iterdir()) == [OUTPUT_MARKER, SKIPPED_FILE]  # the stage's own folder
    assert json.loads(report.read_text()) == {"skipped": True, "reason": "export.enabled: false", "output": str(out)}
    assert export_or_none(out) is None and export_or_none(tmp_path) == tmp_path and export_or_none(None) is None
    finetuned = tmp_path / "finetuned"
    finetuned.mkdir()
    (finetuned / "model_index.json").write_text("{}")
    assert model_artifacts(finetuned, out, None) == {"finetuned": str(finetuned)}


def test_a_bf16_component_loads_in_float32_where_the_cpu_would_emulate_bf16(tmp_path_factory, tmp_path, monkeypatch):
    """A component stored in bf16 loads, and its PyTorch reference runs, in bf16 on a CPU with native
    bf16 and in float32 on an AVX2-only one (flags faked both ways), whose preflight counts it twice."""
    import torch

    from tasks.common.errors import UserError
    from tasks.export import components

    src = bf16_unet_pipeline(tmp_path_factory, tmp_path / "bf16-base")
    monkeypatch.setenv("FINETUNE_CPU_FLAGS", "avx2 avx512f avx512_bf16 amx_bf16")
    assert components.load_dtypes(src) == {"unet": torch.bfloat16, "text_encoder": torch.float32,
                                           "vae": torch.float32}
    stored = sum(p.stat().st_size for p in (src / "unet").rglob("*.safetensors"))
    monkeypatch.setattr(components, "available_bytes", lambda: int(components.PHASE_PER_WEIGHT_MIN * stored) + 1)
    assert components.preflight(src)["unet"] == round(stored / 2 ** 30, 2)
    monkeypatch.setenv("FINETUNE_CPU_FLAGS", "avx avx2 fma")
    assert components.load_dtypes(src)["unet"] == torch.float32
    with pytest.raises(UserError, match=r"unet holds 0\.0 GB of weights in float32 \(stored in bf16, which this "
                                        r"CPU would emulate\)"):
        components.preflight(src)
