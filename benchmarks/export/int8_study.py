"""Where the 8-bit UNet's time goes, and NNCF's options against the int8 bound (SD 1.5 architecture).

    .venv/bin/python -m benchmarks.export.int8_study --report benchmarks/export/results_int8_study.json

SD 1.5's UNet (random weights, benchmarks/export/sd15_random.py; its OpenVINO export shared with
benchmarks/adapters) fixed to the export stage's shape at 512 px with guidance (batch 2), then one
variant per NNCF recipe: none (bf16, what `inference_precision: auto` runs here), 8-bit weights
only, the stage's `hybrid` and `full_int8` (optimum-intel's own code paths), and full int8 with
NNCF's other options. For each: seconds per UNet call, the CPU plugin's per-node profile (time in
matrix products by the precision they ran in, reorders, quantize ops, the rest), PSNR of the UNet's
output against f32 on held-out inputs, and the PSNR of a whole 20-step image against the PyTorch
fp32 pipeline from the same latents. Bounds (`bounds()`): the time left if the convolutions and
MatMuls cost nothing (the rest as profiled in the fastest run of the precision), and the same with
them at the rate of one large matrix product through the plugin.

Quantized UNets are kept in `--work`/unets: a second run only times, profiles and compares them.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import pickle
import re
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.adapters.bench import cpu_name
from benchmarks.export import ov_profile

log = logging.getLogger("benchmarks.export.int8_study")

PROMPTS = ["a photo of a toy", "a photo of sks toy on the beach"]
HELD_OUT = "a red car parked in the snow"
IMAGE_PROMPT = "a photo of sks toy"


def _stage_full_int8(model: Any, data: Any, n: int) -> Any:
    """The export stage's `full_int8`: optimum-intel's full quantization with its defaults."""
    from optimum.intel import OVQuantizationConfig
    from optimum.intel.openvino.quantization import _full_quantization

    return _full_quantization(model, OVQuantizationConfig(bits=8, sym=False, num_samples=n), data)


def _stage_hybrid(model: Any, data: Any, n: int) -> Any:
    """The export stage's `hybrid`: convolutions in full int8, MatMul weights 8-bit only."""
    from optimum.intel import OVWeightQuantizationConfig
    from optimum.intel.openvino.quantization import (
        _get_hybrid_mixed_quantization_config,
        _mixed_quantization,
    )

    cfg = OVWeightQuantizationConfig(bits=8, sym=False, num_samples=n, quant_method="hybrid",
                                     dataset=PROMPTS)
    return _mixed_quantization(model, _get_hybrid_mixed_quantization_config(model, cfg), data)


def _nncf_full(**options: Any) -> Callable[[Any, Any, int], Any]:
    """Full int8 through nncf.quantize directly, with `options` over the stage's settings."""
    def run(model: Any, data: Any, n: int) -> Any:
        import nncf
        from nncf.quantization.advanced_parameters import (
            AdvancedQuantizationParameters,
            AdvancedSmoothQuantParameters,
        )

        given = dict(options)
        alpha = given.pop("smooth_quant_matmul", 0.95)
        kwargs = {"preset": nncf.QuantizationPreset.MIXED, "model_type": nncf.ModelType.TRANSFORMER,
                  "fast_bias_correction": True, "subset_size": n,
                  "advanced_parameters": AdvancedQuantizationParameters(
                      smooth_quant_alphas=AdvancedSmoothQuantParameters(matmul=alpha))}
        kwargs.update(given)
        return nncf.quantize(model, data, **kwargs)

    return run


def _weights_int8(model: Any, data: Any, n: int) -> Any:
    import nncf

    return nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT8_ASYM)


def variants() -> dict[str, Callable[[Any, Any, int], Any] | None]:
    import nncf

    return {
        "bf16": None,
        "int8_weights": _weights_int8,
        "hybrid (stage)": _stage_hybrid,
        "full_int8 (stage)": _stage_full_int8,
        "full_int8 target CPU": _nncf_full(target_device=nncf.TargetDevice.CPU),
        "full_int8 symmetric (performance preset)": _nncf_full(preset=nncf.QuantizationPreset.PERFORMANCE),
        "full_int8 no SmoothQuant": _nncf_full(smooth_quant_matmul=-1),
    }


def static_unet(core: Any, export: Path, size: int) -> Any:
    model = core.read_model(export / "unet" / "openvino_model.xml")
    latent = size // 8
    model.reshape({"sample": [2, 4, latent, latent], "timestep": [1], "encoder_hidden_states": [2, 77, 768]})
    return model


def _ov_pipe(folder: Path, size: int, precision: str) -> Any:
    from tasks.common.openvino_model import StaticShape, load_ov_pipeline
    from tasks.export.core import fix_static_shape

    pipe = load_ov_pipeline(folder, static=False, precision=precision)
    fix_static_shape(pipe, StaticShape(1, size, size, 1))
    pipe.compile()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def unet_inputs(export: Path, work: Path, size: int, steps: int) -> tuple[list[dict], list[dict]]:
    """UNet inputs of the f32 export's own runs (cached): `steps` calls per calibration prompt,
    and 4 calls of a held-out prompt for the output check."""
    cache = work / f"unet_inputs_{size}_{steps}.pkl"
    if cache.is_file():
        return pickle.loads(cache.read_bytes())
    from optimum.intel.openvino.quantization import InferRequestWrapper

    pipe = _ov_pipe(export, size, "f32")
    runs = []
    for prompts, n in ((PROMPTS, steps), ([HELD_OUT], 4)):
        collected: list[dict] = []
        pipe.unet.request = InferRequestWrapper(pipe.unet.request, collected)
        for prompt in prompts:
            pipe(prompt=prompt, height=size, width=size, num_inference_steps=n)
        pipe.unet.request = pipe.unet.request.request
        runs.append([{k: np.array(v) for k, v in item.items()} for item in collected])
    cache.write_bytes(pickle.dumps(tuple(runs)))
    return runs[0], runs[1]


def pytorch_reference(pytorch: Path, work: Path, size: int, steps: int) -> dict[str, Any]:
    """The PyTorch fp32 pipeline's image (the export stage's parity call) and its eager UNet time
    per call, cached in `work`."""
    cache = work / f"pytorch_{size}_{steps}.pkl"
    if cache.is_file():
        return pickle.loads(cache.read_bytes())
    import torch
    from diffusers import StableDiffusionPipeline

    from finetune_runtime import pipeline_call
    from tasks.common import families
    from tasks.common.openvino_model import StaticShape
    from tasks.export.config import ParityConfig
    from tasks.export.parity import pytorch_call

    pipe = StableDiffusionPipeline.from_pretrained(pytorch, dtype=torch.float32)
    times: list[float] = []
    pipe.unet.register_forward_pre_hook(lambda *a: times.append(-time.perf_counter()))
    pipe.unet.register_forward_hook(lambda *a: times.append(times.pop() + time.perf_counter()))
    cfg = ParityConfig(prompt=IMAGE_PROMPT, num_inference_steps=steps, min_psnr_db=None)
    run = pytorch_call(pipe, StaticShape(1, size, size, 1), cfg)
    convention = families.of_pipeline(pipe).call_convention()
    ref = {"latents": run.latents, "kwargs": pipeline_call.call_arguments(convention=convention, **run.call),
           "images": run.images,
           "eager_unet_s": sorted(times)[len(times) // 2], "eager_pipeline_s": run.seconds}
    cache.write_bytes(pickle.dumps(ref))
    return ref


def image_psnr(export: Path, unet: Path, folder: Path, ref: dict[str, Any], size: int) -> float:
    """PSNR of the pipeline's image with the UNet file `unet` in place of the export's, against
    PyTorch fp32."""
    from tasks.common.outputs import link_tree
    from tasks.common.psnr import psnr_db

    shutil.rmtree(folder, ignore_errors=True)
    link_tree(export, folder)
    for f in (folder / "unet").glob("openvino_model.*"):
        f.unlink()
    for f in unet.parent.glob("openvino_model.*"):
        os.link(f, folder / "unet" / f.name)
    pipe = _ov_pipe(folder, size, "auto")
    images = pipe(latents=ref["latents"].clone(), **ref["kwargs"]).images
    del pipe
    shutil.rmtree(folder)
    return round(psnr_db(ref["images"], images), 2)


def unet_psnr(compiled: Any, reference: list[np.ndarray], held_out: list[dict]) -> float:
    from tasks.common.psnr import psnr_db

    out = np.stack([compiled(x)[0] for x in held_out])
    ref = np.stack(reference)
    peak = float(ref.max() - ref.min())
    return round(psnr_db((out - ref.min()) / peak, (ref - ref.min()) / peak), 2)


def quantized_unet(name: str, make: Any, core: Any, args: argparse.Namespace,
                   calibration: list[dict]) -> tuple[Path, float]:
    """The variant's UNet file (static shape) and its quantization seconds, made once into
    `args.work`/unets (delete it to redo)."""
    import nncf
    import openvino as ov

    folder = args.work / "unets" / re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    path, meta = folder / "openvino_model.xml", folder / "quantize.json"
    if not meta.is_file():
        model = static_unet(core, args.export, args.size)
        start = time.perf_counter()
        if make is not None:
            model = make(model, nncf.Dataset(calibration), len(calibration))
        seconds = time.perf_counter() - start
        folder.mkdir(parents=True, exist_ok=True)
        ov.save_model(model, path, compress_to_fp16=False)
        meta.write_text(json.dumps({"quantize_s": round(seconds, 1)}))
    return path, json.loads(meta.read_text())["quantize_s"]


def study(name: str, make: Any, core: Any, args: argparse.Namespace, data: tuple, ref: dict,
          f32_outputs: list[np.ndarray]) -> dict[str, Any]:
    calibration, held_out = data
    path, quantize_s = quantized_unet(name, make, core, args, calibration)
    model = core.read_model(path)
    compiled = core.compile_model(model, "CPU", {})
    request = compiled.create_infer_request()
    seconds = ov_profile.time_calls(request, calibration[0], args.calls)
    row = {
        "quantize_s": quantize_s,
        "unet_s": round(min(seconds), 3), "unet_s_median": round(float(np.median(seconds)), 3),
        "unet_s_all": [round(s, 3) for s in seconds],
        "compiled_precision": str(compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name()),
        "unet_output_psnr_db": unet_psnr(compiled, f32_outputs, held_out),
    }
    del request, compiled
    row["profile"] = ov_profile.profile_model(core, model, calibration[0], {})
    row["image_psnr_vs_pytorch_db"] = image_psnr(args.export, path, args.work / "variant", ref, args.size)
    log.info("%s: %s", name, {k: v for k, v in row.items() if k != "profile"})
    return row


def bounds(core: Any, flops: dict[str, float], rows: dict[str, Any]) -> dict[str, Any]:
    """Two bounds per precision. `gemm_peak`: the convolutions and MatMuls at the best rate of one
    large matrix product through the plugin, plus everything else as measured in the fastest run of
    that precision. `free_gemm`: everything else alone (the matrix products cost nothing), scaled
    from profiled to wall time: no 8-bit recipe can go below it."""
    out = {}
    for key, int8 in (("bf16", False), ("int8", True)):
        runs = [r for n, r in rows.items() if (n != "bf16" and "int8_weights" not in n) == int8]
        if not runs:
            continue
        best = min(runs, key=lambda r: r["unet_s"])
        profile = best["profile"]
        peaks = [ov_profile.gemm_peak_gflops(core, int8, n) for n in (2048, 4096) for _ in range(3)]
        peak = max(peaks, key=lambda p: p["gflops"])
        rest_s = profile["non_gemm_ms"] / profile["total_ms"] * best["unet_s"]
        out[key] = {
            "fastest_s": best["unet_s"], "gemm_peak": peak,
            "gemm_rate_in_unet_gflops": round(flops["conv_matmul"] / (profile["gemm_ms"] / 1e3) / 1e9, 1),
            "gemm_peak_bound_s": round(flops["conv_matmul"] / peak["gflops"] / 1e9 + rest_s, 3),
            "free_gemm_bound_s": round(rest_s, 3),
            "pct_of_free_gemm_bound": round(100 * rest_s / best["unet_s"], 1),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pytorch", type=Path, default=Path(".cache/bench/sd15-arch"))
    parser.add_argument("--export", type=Path, default=Path(".cache/bench/adapters/base"))
    parser.add_argument("--work", type=Path, default=Path(".cache/bench/int8"))
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20, help="image steps (PSNR against PyTorch)")
    parser.add_argument("--calibration-steps", type=int, default=6, help="UNet calls per calibration prompt")
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--only", nargs="*", help="variant names to run (default: all)")
    parser.add_argument("--report", type=Path, default=Path("benchmarks/export/results_int8_study.json"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    import openvino as ov

    from tasks.common.memory import release_memory
    from tasks.export.runtime import base_export

    args.work.mkdir(parents=True, exist_ok=True)
    if not (args.pytorch / "model_index.json").is_file():
        from benchmarks.export.sd15_random import build_sd15

        build_sd15(args.pytorch)
    if not (args.export / "model_index.json").is_file():
        base_export(args.pytorch, args.export, Path(".cache/openvino-base"))
    ref = pytorch_reference(args.pytorch, args.work, args.size, args.steps)
    release_memory()
    data = unet_inputs(args.export, args.work, args.size, args.calibration_steps)
    core = ov.Core()
    f32 = core.compile_model(static_unet(core, args.export, args.size), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    f32_outputs = [f32(x)[0] for x in data[1]]
    del f32
    flops = ov_profile.gemm_flops(static_unet(core, args.export, args.size))
    rows = {}
    for name, make in variants().items():
        if args.only and name not in args.only:
            continue
        rows[name] = study(name, make, core, args, data, ref, f32_outputs)
        release_memory()
    report = {
        "command": "python -m benchmarks.export.int8_study " + " ".join(sys.argv[1:]),
        "cpu": cpu_name(), "cpus": os.cpu_count(),
        "size": args.size, "unet_batch": 2, "calibration_samples": len(data[0]),
        "unet_gflop": {k: round(v / 1e9, 1) for k, v in flops.items()},
        "eager_fp32_unet_s": round(ref["eager_unet_s"], 3),
        "variants": rows,
    }
    report["bounds"] = bounds(core, flops, rows)
    args.report.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "variants"}, indent=2))
    for name, row in rows.items():
        print(f"{name:45s} {row['unet_s']:7.3f} s  {ref['eager_unet_s'] / row['unet_s']:5.2f}x eager  "
              f"unet {row['unet_output_psnr_db']:5.1f} dB  image {row['image_psnr_vs_pytorch_db']:5.1f} dB")


if __name__ == "__main__":
    main()
