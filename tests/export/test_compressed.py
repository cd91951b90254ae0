"""Adapters-only train output -> fused, exported, int8-compressed; the four latencies recorded.

One real export (the expensive part: ~20-60 s on 2 cores) covers LoRA fusion, a new token,
NNCF weight compression, the dynamic / static / compressed timings and the single-file checkpoint.
"""
from __future__ import annotations

import pytest

from tasks.export.compress import quantization_config
from tasks.export.config import CompressionConfig, ExportConfig
from tests.export.adapters import TOKEN, write_adapters
from tests.export.tiny_ov import PARITY_FAST, tiny_pipeline


@pytest.fixture(scope="module")
def compressed_export(tmp_path_factory):
    from tasks.export.core import export

    base = tiny_pipeline(tmp_path_factory, "builtin:tiny-sd")
    work = tmp_path_factory.mktemp("compressed")
    adapters = write_adapters(base, work / "adapters")
    cfg = ExportConfig(parity=PARITY_FAST, compression={"mode": "int8"}, single_file="fp16")
    out = work / "openvino"
    return out, export(adapters, out, cfg, base=base)


def test_adapter_export_knows_the_concept(compressed_export):
    from tasks.common.openvino_model import load_ov_pipeline

    out, report = compressed_export
    assert report["source_kind"]["method"] == "lora+textual_inversion"
    assert report["source_kind"]["tokens"] == [TOKEN]
    assert report["parity"]["passed"] and report["parity"]["image_psnr_db"] >= 30.0
    pipe = load_ov_pipeline(out, static=True)
    token_id = pipe.tokenizer.convert_tokens_to_ids(TOKEN)
    assert token_id == len(pipe.tokenizer) - 1
    images = pipe(f"a photo of {TOKEN} toy", num_inference_steps=2, output_type="np").images
    assert images.shape == (1, 64, 64, 3)
    # The single-file checkpoint beside it carries the fused LoRA and the new token's row.
    from safetensors import safe_open

    assert report["single_file"]["path"] == "single_file/model.safetensors"
    with safe_open(str(out / report["single_file"]["path"]), "pt") as fh:
        rows = fh.get_slice(
            "cond_stage_model.transformer.text_model.embeddings.token_embedding.weight"
        ).get_shape()[0]
    assert rows == len(pipe.tokenizer)


def test_int8_is_smaller_close_to_fp32_and_timed(compressed_export):
    _, report = compressed_export
    sizes, comp, lat = report["size_mb"], report["compression"], report["latency_s"]
    assert comp["mode"] == "int8" and comp["passed"] and comp["finite"]
    assert comp["psnr_vs_openvino_fp32_db"] > 25.0
    # int8 weights: the UNet's linear/conv weights shrink ~4x; the whole folder at least 2x.
    assert sizes["openvino_compressed"] < sizes["openvino_fp32"] / 2
    # The folder holds the compressed model and the single-file checkpoint, nothing else.
    single = report["single_file"]["size_mb"]
    assert sizes["openvino"] == pytest.approx(sizes["openvino_compressed"] + single, abs=0.01)
    for key in ("pytorch_eager", "openvino_dynamic", "openvino_static", "openvino_compressed"):
        assert lat[key] > 0
        if key != "pytorch_eager":
            assert lat[f"speedup_{key.removeprefix('openvino_')}_vs_eager"] > 0


def _quantized_inputs(model, op_type: str) -> tuple[int, int]:
    """(ops of `op_type`, how many take a FakeQuantize output: 8-bit activations) in `model`."""
    ops = [op for op in model.get_ops() if op.get_type_name() == op_type]
    fed = [
        op for op in ops
        if op.input_value(0).get_node().get_type_name() == "FakeQuantize"
    ]
    return len(ops), len(fed)


def test_full_int8_quantizes_every_unet_layer(tmp_path_factory):
    """full_int8: the UNet's convolutions and MatMuls all take 8-bit activations; the report
    times it; the other models keep float activations (weights-only 8 bit)."""
    import openvino as ov

    from tasks.export.core import export

    base = tiny_pipeline(tmp_path_factory, "builtin:tiny-sd")
    out = tmp_path_factory.mktemp("full-int8") / "openvino"
    cfg = ExportConfig(
        parity=PARITY_FAST, latency_dynamic=False,
        compression={"mode": "full_int8", "num_samples": 4, "calibration_prompts": ["a toy"]},
    )
    report = export(base, out, cfg)
    assert report["compression"]["mode"] == "full_int8" and report["compression"]["finite"]
    assert report["latency_s"]["speedup_compressed_vs_eager"] > 0
    core = ov.Core()
    unet = core.read_model(out / "unet" / "openvino_model.xml")
    for op_type in ("Convolution", "MatMul"):
        total, quantized = _quantized_inputs(unet, op_type)
        assert total > 0 and quantized >= total * 0.8, (op_type, total, quantized)
    text = core.read_model(out / "text_encoder" / "openvino_model.xml")
    assert _quantized_inputs(text, "MatMul")[1] == 0


def test_quantization_configs():
    assert quantization_config(CompressionConfig()) is None
    q4 = quantization_config(CompressionConfig(mode="int4", group_size=32, ratio=0.8))
    assert (q4.bits, q4.group_size, q4.ratio) == (4, 32, 0.8)
    hybrid = quantization_config(CompressionConfig(mode="hybrid", num_samples=8))
    assert hybrid.bits == 8 and hybrid.dataset and hybrid.num_samples == 8
    assert str(hybrid.quant_method).lower().endswith("hybrid")
    full = quantization_config(CompressionConfig(mode="full_int8", num_samples=8))
    assert type(full).__name__ == "OVQuantizationConfig" and full.num_samples == 8
    assert full.dataset == list(CompressionConfig().calibration_prompts)
    for mode in ("hybrid", "full_int8"):
        with pytest.raises(ValueError, match="calibration_prompts"):
            CompressionConfig(mode=mode, calibration_prompts=[])


def test_hybrid_quantizes_after_releasing_the_calibration_models(tmp_path_factory, monkeypatch):
    """hybrid: the calibration run compiles the whole pipeline; by the time NNCF quantizes the
    UNet (its statistics collection is the step with the highest memory), no component may still
    hold a compiled model (5-6 GB on SD 1.5). The UNet still comes out quantized."""
    import nncf

    from tasks.common.families import StableDiffusion
    from tasks.export.compress import quantize
    from tests.export.tiny_ov import exported

    _, fp32_dir, _ = exported(tmp_path_factory, "builtin:tiny-sd", batch_size=2, height=64,
                              width=64, num_images_per_prompt=1)
    pipe = StableDiffusion.export.ov_pipeline_class().from_pretrained(fp32_dir, compile=False)
    compiled_when_quantizing = []
    real_quantize = nncf.quantize

    def recording_quantize(model, *args, **kwargs):
        compiled_when_quantizing.append(sorted(
            name for name, part in pipe.components.items()
            if getattr(part, "request", None) is not None
        ))
        return real_quantize(model, *args, **kwargs)

    monkeypatch.setattr(nncf, "quantize", recording_quantize)
    quantize(pipe, quantization_config(CompressionConfig(
        mode="hybrid", num_samples=4, calibration_prompts=["a toy"])))
    assert compiled_when_quantizing == [[]]  # called once (the UNet), nothing compiled then
    total, quantized = _quantized_inputs(pipe.unet.model, "Convolution")
    assert total > 0 and quantized >= total * 0.8, (total, quantized)
