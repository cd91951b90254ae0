"""Export of the tiny SD / SDXL pipelines to OpenVINO at static shapes (real optimum-intel)."""
from __future__ import annotations

import json
import sys

import pytest
import yaml

from tasks.common.openvino_model import StaticShape, load_ov_pipeline, static_shape
from tasks.export.config import ExportConfig, ParityConfig
from tasks.export.parity import pytorch_run, run_parity
from tests.export.tiny_ov import PARITY_FAST, exported, tiny_pipeline

SD_SHAPE = {"batch_size": 2, "height": 64, "width": 64, "num_images_per_prompt": 1}


@pytest.fixture(scope="module")
def sd_export(tmp_path_factory):
    return exported(tmp_path_factory, "builtin:tiny-sd", **SD_SHAPE)


def test_export_loads_with_optimum_and_keeps_static_shape(sd_export):
    from optimum.intel import OVStableDiffusionPipeline

    _, out, report = sd_export
    # The contract: loads with the plain optimum-intel call (which makes the shapes dynamic again).
    plain = OVStableDiffusionPipeline.from_pretrained(out)
    images = plain(["a photo of sks toy"], num_inference_steps=1, output_type="np").images
    assert images.shape == (1, 64, 64, 3)

    pipe = load_ov_pipeline(out, static=True)
    assert static_shape(pipe) == StaticShape(2, 64, 64, 1)
    images = pipe(["a sks toy", "a red sks toy"], num_inference_steps=2, output_type="pil").images
    assert [im.size for im in images] == [(64, 64), (64, 64)]
    # Static: the UNet takes exactly 2 images per call (one prompt with 2 images also fits) ...
    assert len(pipe("a sks toy", num_images_per_prompt=2, num_inference_steps=1).images) == 2
    with pytest.raises(RuntimeError, match="incompatible"):
        pipe(["a", "b", "c"], num_inference_steps=1)

    assert report["static_shape"] == SD_SHAPE
    assert report["family"] == "sd" and report["pipeline_class"] == "OVStableDiffusionPipeline"
    assert report["size_mb"]["openvino"] > 0
    assert set(report["size_mb"]["components"]) >= {"unet", "vae_decoder", "text_encoder"}
    assert report["seconds"]["export"] > 0


def test_parity_of_a_faithful_export_passes(sd_export):
    parity = sd_export[2]["parity"]
    assert parity["passed"] and parity["finite"]
    assert parity["image_psnr_db"] >= 30.0
    assert parity["image_max_abs_diff"] < 1e-2
    latency = sd_export[2]["latency_s"]
    assert latency["pytorch_eager"] > 0 and latency["openvino_static"] > 0


def test_precision_is_recorded_timed_and_kept_with_the_model(sd_export, tmp_path):
    """Parity in f32; the static timing at export.inference_precision (default auto); the folder
    says how to compile it, and every loader follows (f32 forced here in a copy)."""
    import shutil

    from tasks.common.openvino_model import (
        RUNTIME_FILE,
        compiled_precisions,
        runtime_config,
        write_runtime_config,
    )

    _, out, report = sd_export
    precision = report["inference_precision"]
    assert precision["requested"] == "auto" and precision["finite"]
    assert set(precision["compiled_precision"]) == {"text_encoder", "unet", "vae_decoder"}
    # auto means no hint: each model runs at what a plain OpenVINO compile picks on this CPU.
    import openvino as ov

    core = ov.Core()
    for name, used in precision["compiled_precision"].items():
        plain = core.compile_model(core.read_model(out / name / "openvino_model.xml"), "CPU")
        assert used == plain.get_property("INFERENCE_PRECISION_HINT").get_type_name(), name
    # Lower precision still has to look like the fp32 images (tiny models: > 25 dB measured).
    assert precision["psnr_vs_openvino_fp32_db"] > 25.0
    latency = report["latency_s"]
    assert latency["openvino_static_f32"] > 0 and latency["speedup_static_f32_vs_eager"] > 0
    assert runtime_config(out) == {}  # auto: no hint, OpenVINO chooses

    forced = tmp_path / "f32"
    shutil.copytree(out, forced)
    write_runtime_config(forced, "f32")
    pipe = load_ov_pipeline(forced, static=True)
    assert set(compiled_precisions(pipe).values()) == {"f32"}
    (forced / RUNTIME_FILE).unlink()  # exports from before the file: fp32, as they were made
    assert runtime_config(forced) == {"INFERENCE_PRECISION_HINT": "f32"}


def test_f32_precision_times_the_parity_pipeline(tmp_path_factory, tmp_path):
    """inference_precision f32: the static figure comes from the parity run's own pipeline, at
    f32, identical to it; the folder records f32."""
    from tasks.common.openvino_model import runtime_config
    from tasks.export.core import export

    src = tiny_pipeline(tmp_path_factory, "builtin:tiny-sd")
    cfg = ExportConfig(inference_precision="f32", latency_dynamic=False, parity=PARITY_FAST)
    report = export(src, tmp_path / "ov", cfg)
    precision = report["inference_precision"]
    assert set(precision["compiled_precision"].values()) == {"f32"}
    assert precision["psnr_vs_openvino_fp32_db"] == 100.0
    assert report["latency_s"]["openvino_static"] > 0
    assert runtime_config(tmp_path / "ov") == {"INFERENCE_PRECISION_HINT": "f32"}


def test_parity_catches_wrong_weights(sd_export, tmp_path_factory):
    """The same export compared with a different model (other seed) must fail the gate."""
    _, out, _ = sd_export
    other = tiny_pipeline(tmp_path_factory, "builtin:tiny-sd", seed=1)
    pipe = load_ov_pipeline(out, static=True)
    cfg = ParityConfig(**PARITY_FAST)
    parity, _, _ = run_parity(pytorch_run(other, StaticShape(**SD_SHAPE), cfg), pipe, cfg)
    assert not parity["passed"]
    assert parity["image_psnr_db"] < 30.0


def test_sdxl_export(tmp_path_factory):
    from optimum.intel import OVStableDiffusionXLPipeline

    shape = {"batch_size": 1, "height": 64, "width": 64}
    _, out, report = exported(tmp_path_factory, "builtin:tiny-sdxl", **shape)
    assert report["pipeline_class"] == "OVStableDiffusionXLPipeline" and report["parity"]["passed"]
    pipe = OVStableDiffusionXLPipeline.from_pretrained(out, dynamic_shapes=False)
    assert static_shape(pipe) == StaticShape(1, 64, 64, 1)
    dynamic = OVStableDiffusionXLPipeline.from_pretrained(out)  # any batch after a plain load
    assert len(dynamic(["a", "b"], num_inference_steps=1).images) == 2
    assert pipe("a sks toy", num_inference_steps=2, output_type="np").images.shape == (1, 64, 64, 3)


def test_config_rejects_bad_shapes():
    from tasks.common.config import parse_section
    from tasks.common.errors import UserError

    with pytest.raises(UserError, match="export.height"):
        parse_section("export", {"height": 60}, ExportConfig)
    with pytest.raises(UserError, match="export.parity.guidance_scale"):
        parse_section("export", {"parity": {"guidance_scale": 1.0}}, ExportConfig)
    with pytest.raises(UserError, match="unknown key"):
        parse_section("export", {"batchsize": 2}, ExportConfig)
    with pytest.raises(UserError, match="export.inference_precision"):
        parse_section("export", {"inference_precision": "fp8"}, ExportConfig)


def _run_cli(monkeypatch, capsys, *args: str) -> int:
    from tasks.export.__main__ import main

    monkeypatch.setattr(sys, "argv", ["python -m tasks.export", *args])
    try:
        main()
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


def test_cli_missing_model_is_a_user_error(tmp_path, monkeypatch, capsys):
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"export": {}}))
    code = _run_cli(
        monkeypatch, capsys, "--model", str(tmp_path / "nope"), "--out", str(tmp_path / "ov"),
        "--report", str(tmp_path / "r.json"), "--params", str(params),
    )
    assert code == 2
    assert "run the train stage first" in capsys.readouterr().err
    assert not (tmp_path / "ov").exists()


def test_cli_failed_parity_leaves_no_model(tmp_path_factory, tmp_path, monkeypatch, capsys):
    """An impossible parity threshold: the real export runs, the stage fails, nothing is written."""
    src = tiny_pipeline(tmp_path_factory, "builtin:tiny-sd")
    params = tmp_path / "params.yaml"
    parity = {**PARITY_FAST, "min_psnr_db": 1000.0}
    params.write_text(yaml.safe_dump({"export": {"parity": parity}}))
    out, report = tmp_path / "models" / "openvino", tmp_path / "reports" / "export.json"
    code = _run_cli(
        monkeypatch, capsys, "--model", str(src), "--out", str(out), "--report", str(report),
        "--params", str(params),
    )
    assert code == 2
    assert "parity check failed" in capsys.readouterr().err
    assert not out.exists() and not list(out.parent.iterdir())  # no temp folder left either
    written = json.loads(report.read_text())
    assert written["parity"]["passed"] is False and written["parity"]["image_psnr_db"] > 30


def test_torchvision_stays_out():
    """optimum-intel declares torchvision; its registry build breaks transformers (STACK.md)."""
    import importlib.util

    assert importlib.util.find_spec("torchvision") is None
    assert "torchvision" not in sys.modules
