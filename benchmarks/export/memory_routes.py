"""Peak memory of converting one real-size denoiser to an int8 OpenVINO IR, by route (issue 57).

The denoiser is Sana 1600M's transformer (1.60B parameters, 3.2 GB in bf16) as
benchmarks/sana/build.py writes it from the published configs with seeded random weights. Each
route runs in a process of its own, so its peaks are its own; inside it every phase's peak is the
kernel's high-water mark (VmHWM), reset at the phase's start (`/proc/self/clear_refs` 5), with the
resident memory split into anonymous and file-backed pages sampled every 0.1 s beside it.

Routes (all end with the same written int8 IR, checked on the same seeded inputs):

- `today`: what tasks/export/components.py does for one group with `compression.mode: int8`
  (its own functions, called unchanged): the pipeline loaded with the transformer in bf16 and the
  rest on the meta device (the VAE real), the PyTorch reference run, optimum-intel's
  `export_models` (TorchScript trace with the 16-bit patch, `ov.convert_model`, bf16 IR saved),
  the bf16 IR compiled in f32 for the parity check, NNCF's `compress_weights` (INT8_ASYM) on the
  IR read back, and the compressed IR saved;
- `compress_first`: the same load and reference, then NNCF's torch backend compresses the module
  in place (INT8_ASYM, one example input to trace it), then the same `export_models` on the
  compressed module (traced in f32 activations: the NNCF decompressors' output set to float32),
  so no bf16 IR is written and none compiled;
- `stream`: no bf16 module at all: the transformer is built on the meta device, every Linear and
  Conv2d swapped for an 8-bit one (per output channel, asymmetric, as NNCF's INT8_ASYM), and the
  safetensors file read one tensor at a time, each weight quantized as it is read; then the same
  `export_models`;
- `stream_ext`: `stream`, the 8-bit Linear and 1x1 Conv layers traced as custom ops (OpenVINO
  ModuleExtension + ConversionExtension: nothing computed while tracing, the same decompression
  pattern in the IR);
- `stream_ext_b1`: `stream_ext` traced on a batch of 1 (optimum's default is 2);
- `stream_lean`: `stream_ext_b1` with the VAE on the meta device, the safetensors read with plain
  file reads (no mapping), and the module's tensors freed before the final check.

`reference` (run first) computes the PyTorch bf16 and fp32 outputs on the seeded inputs every
route is compared with (written to the work folder).

    .venv/bin/python -m benchmarks.sana.build --out .cache/bench/sana-1600m
    nice -n 5 .venv/bin/python -m benchmarks.export.memory_routes                 # every route
    nice -n 5 .venv/bin/python -m benchmarks.export.memory_routes --route today   # one route (+ reference)
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("benchmarks.export.memory_routes")
ROUTES = ("today", "compress_first", "stream", "stream_ext", "stream_ext_b1", "stream_lean",
          "stream_lean_small")
NAME = "transformer"
SEED = 0


# ---------------------------------------------------------------- measuring
def _status() -> dict[str, float]:
    """VmRSS, RssAnon, RssFile, VmHWM of this process in MB."""
    out = {}
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            key = line.split(":", 1)[0]
            if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                out[key] = int(line.split()[1]) / 1024
    return out


class Phases:
    """Sequential phases: `mark(name)` ends the open phase and opens `name`. Each phase gets its exact
    peak RSS (VmHWM reset at its start), the sampled peak of its anonymous and file-backed parts, the
    RSS at its end and its seconds."""

    def __init__(self, interval: float = 0.1) -> None:
        self.rows: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.timeline: list[tuple[float, float, float]] = []
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._sample, args=(interval,), daemon=True)
        self._thread.start()

    def _sample(self, interval: float) -> None:
        while not self._stop.wait(interval):
            s = _status()
            with self._lock:
                if len(self.timeline) < 20000:
                    stamp = round(time.perf_counter() - self._t0, 2)
                    self.timeline.append((stamp, round(s["RssAnon"]), round(s["RssFile"])))
                if self._open is not None:
                    o = self._open
                    o["anon_max"] = max(o["anon_max"], s["RssAnon"])
                    o["file_max"] = max(o["file_max"], s["RssFile"])
                    o["rss_sampled_max"] = max(o["rss_sampled_max"], s["VmRSS"])

    def mark(self, name: str | None) -> None:
        with self._lock:
            if self._open is not None:
                s = _status()
                o = self._open
                o["peak_rss_mb"] = round(max(s["VmHWM"], o["rss_sampled_max"]), 1)
                o["end_rss_mb"] = round(s["VmRSS"], 1)
                o["end_anon_mb"], o["end_file_mb"] = round(s["RssAnon"], 1), round(s["RssFile"], 1)
                o["seconds"] = round(time.perf_counter() - o.pop("_start"), 2)
                o["peak_anon_sampled_mb"] = round(o.pop("anon_max"), 1)
                o["peak_file_sampled_mb"] = round(o.pop("file_max"), 1)
                o.pop("rss_sampled_max")
                self.rows.append(o)
                log.info("phase %-14s peak %7.0f MB  (anon %7.0f, file %7.0f sampled)  end %7.0f MB  %6.1f s",
                         o["phase"], o["peak_rss_mb"], o["peak_anon_sampled_mb"], o["peak_file_sampled_mb"],
                         o["end_rss_mb"], o["seconds"])
                self._open = None
            if name is None:
                return
            with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
                fh.write("5")  # resets VmHWM to the current RSS
            s = _status()
            self._open = {"phase": name, "start_rss_mb": round(s["VmRSS"], 1), "_start": time.perf_counter(),
                          "anon_max": s["RssAnon"], "file_max": s["RssFile"], "rss_sampled_max": s["VmRSS"]}

    def close(self) -> None:
        self.mark(None)
        self._stop.set()
        self._thread.join()


# ---------------------------------------------------------------- shared steps
def _pipeline(src: Path, real: str) -> tuple[Any, dict[str, Any]]:
    """tasks.export.components.load_for's pipeline: `real` (and the VAE) in their stored dtypes, the
    other models on the meta device; plus the dtypes."""
    from tasks.common import families
    from tasks.export.components import load_dtypes, load_for

    index = families.read_index(src)
    dtypes = load_dtypes(src, say=False)
    return load_for(src, index, real, dtypes), dtypes


def _export_config_models(pipe: Any) -> dict[str, Any]:
    from optimum.exporters.openvino.convert import get_diffusion_models_for_export_ext
    from optimum.exporters.tasks import TasksManager

    TasksManager.standardize_model_attributes(pipe, library_name="diffusers")
    _, every = get_diffusion_models_for_export_ext(pipe, exporter="openvino")
    return {NAME: every[NAME]}


def _instrumented_convert(models: dict[str, Any], stage: Path, patch_16bit: bool, phases: Phases) -> None:
    """components._convert (optimum-intel's export_models), with phase marks at the TorchScript
    trace, ov.convert_model and the IR's save (optimum's own functions wrapped, not changed)."""
    import openvino.frontend.pytorch.ts_decoder as td
    import optimum.exporters.openvino.convert as oc

    from tasks.export.components import _convert

    orig = (td.TorchScriptPythonDecoder, oc.convert_model, oc._save_model)

    class Decoder(orig[0]):  # a subclass: ovc tells decoders apart by isinstance
        def __init__(self, *a: Any, **k: Any) -> None:
            if k.get("graph_element") is None and (len(a) < 2 or a[1] is None):
                phases.mark("trace")  # the top-level decoder: torch.jit.trace runs in its constructor
            super().__init__(*a, **k)

    decoder = Decoder

    def convert(*a: Any, **k: Any) -> Any:
        phases.mark("ov_convert")
        return orig[1](*a, **k)

    def save(*a: Any, **k: Any) -> Any:
        phases.mark("save_ir")
        out = orig[2](*a, **k)
        phases.mark("export_tail")
        return out

    td.TorchScriptPythonDecoder, oc.convert_model, oc._save_model = decoder, convert, save
    try:
        _convert(models, stage, patch_16bit=patch_16bit)
    finally:
        td.TorchScriptPythonDecoder, oc.convert_model, oc._save_model = orig


def _load_reference(work: Path) -> tuple[dict[str, Any], list[np.ndarray], list[np.ndarray]]:
    import torch

    data = np.load(work / "reference.npz")
    inputs = {k[3:]: torch.from_numpy(data[k]) for k in data.files if k.startswith("in_")}
    n = len([k for k in data.files if k.startswith("bf16_")])
    return inputs, [data[f"bf16_{i}"] for i in range(n)], [data[f"fp32_{i}"] for i in range(n)]


def _check_written(xml: Path, work: Path, phases: Phases, label: str) -> dict[str, Any]:
    """The IR at `xml` compiled in f32 on the reference inputs, against PyTorch bf16 and fp32."""
    from tasks.export import component_check as check

    inputs, bf16, fp32 = _load_reference(work)
    phases.mark(label)
    got = check.openvino_output(xml, inputs)
    return {"vs_pytorch_bf16": check.compare(bf16, got), "vs_pytorch_fp32": check.compare(fp32, got)}


def _sizes(folder: Path) -> dict[str, float]:
    return {p.name: round(p.stat().st_size / 1024 ** 2, 1) for p in sorted(folder.glob("*")) if p.is_file()}


# ---------------------------------------------------------------- routes
def route_reference(src: Path, work: Path, phases: Phases) -> dict[str, Any]:
    """The seeded example inputs and the PyTorch bf16 and fp32 outputs on them, to work/reference.npz."""
    import torch

    from tasks.export import component_check as check
    from tasks.export.components import _references

    phases.mark("load")
    pipe, dtypes = _pipeline(src, NAME)
    models = _export_config_models(pipe)
    module, export_config = models[NAME]
    phases.mark("pytorch_bf16")
    inputs, bf16 = _references(models, SEED, dtypes.get(NAME, torch.float32))[NAME]
    phases.mark("pytorch_fp32")
    module.float()
    fp32 = check.pytorch_output(module, export_config, inputs)
    arrays = {f"in_{k}": v.numpy() for k, v in inputs.items()}
    arrays.update({f"bf16_{i}": a for i, a in enumerate(bf16)})
    arrays.update({f"fp32_{i}": a for i, a in enumerate(fp32)})
    np.savez(work / "reference.npz", **arrays)
    return {"dtype": str(dtypes.get(NAME)), "inputs": {k: list(v.shape) for k, v in inputs.items()},
            "parameters": sum(p.numel() for p in module.parameters()),
            "bf16_vs_fp32": check.compare(fp32, bf16)}


def route_today(src: Path, work: Path, phases: Phases) -> dict[str, Any]:
    """components._group_pass + _check_part for the transformer with compression int8 (asymmetric)."""
    import gc

    import nncf
    import openvino as ov
    import torch

    from tasks.common.memory import release_memory
    from tasks.export import component_check as check
    from tasks.export.components import _references

    stage = work / "today"
    shutil.rmtree(stage, ignore_errors=True)
    gc.freeze()
    phases.mark("load")
    pipe, dtypes = _pipeline(src, NAME)
    models = _export_config_models(pipe)
    dtype = dtypes.get(NAME, torch.float32)
    phases.mark("pytorch_ref")
    refs = _references(models, SEED, dtype)
    _instrumented_convert(models, stage, dtype in (torch.float16, torch.bfloat16), phases)
    phases.mark("release_torch")
    del pipe, models
    release_memory()
    xml = stage / NAME / "openvino_model.xml"
    bf16_ir_mb = round(xml.with_suffix(".bin").stat().st_size / 1024 ** 2, 1)
    phases.mark("check_f32")
    inputs, expected = refs[NAME]
    check_bf16_ir = check.compare(expected, check.openvino_output(xml, inputs))
    phases.mark("compress")
    model = nncf.compress_weights(ov.Core().read_model(xml), mode=nncf.CompressWeightsMode.INT8_ASYM)
    phases.mark("save")
    tmp = xml.with_name(xml.stem + ".compressed.xml")
    ov.save_model(model, tmp, compress_to_fp16=False)
    del model
    os.replace(tmp.with_suffix(".bin"), xml.with_suffix(".bin"))
    os.replace(tmp, xml)
    release_memory()
    result = {"bf16_ir_mb": bf16_ir_mb, "check_of_bf16_ir": check_bf16_ir}
    result["parity"] = _check_written(xml, work, phases, "check_int8")
    result["ir_mb"] = _sizes(xml.parent)
    return result


def route_compress_first(src: Path, work: Path, phases: Phases) -> dict[str, Any]:
    """NNCF's torch backend compresses the bf16 module in place, then optimum-intel converts it."""
    import gc

    import nncf
    import torch
    from optimum.exporters.openvino.utils import _normalize_dummy_inputs

    from tasks.common.memory import release_memory
    from tasks.export.components import _references

    stage = work / "compress_first"
    shutil.rmtree(stage, ignore_errors=True)
    gc.freeze()
    phases.mark("load")
    pipe, dtypes = _pipeline(src, NAME)
    models = _export_config_models(pipe)
    module, export_config = models[NAME]
    dtype = dtypes.get(NAME, torch.float32)
    phases.mark("pytorch_ref")
    inputs, _ = _references(models, SEED, dtype)[NAME]
    phases.mark("compress_torch")
    example = _normalize_dummy_inputs(inputs, dtype)
    with torch.no_grad():
        compressed = nncf.compress_weights(module, mode=nncf.CompressWeightsMode.INT8_ASYM,
                                           dataset=nncf.Dataset([example]))
    release_memory()
    phases.mark("to_f32")
    decompressors = [m for m in compressed.modules() if type(m).__name__.endswith("WeightsDecompressor")]
    for m in decompressors:
        m.result_dtype = torch.float32
    compressed.float()  # the int8 weights stay int8; norms, biases and scales go to f32 (small)
    release_memory()
    models[NAME] = (compressed, export_config)
    _instrumented_convert(models, stage, False, phases)
    phases.mark("release_torch")
    del pipe, models, module, compressed
    release_memory()
    xml = stage / NAME / "openvino_model.xml"
    return {"decompressors": len(decompressors), "parity": _check_written(xml, work, phases, "check_int8"),
            "ir_mb": _sizes(xml.parent)}


class _Int8Weights:
    """Asymmetric 8-bit, one scale and zero point per output channel: NNCF's INT8_ASYM formula."""

    @staticmethod
    def quantize(w: Any) -> tuple[Any, Any, Any]:
        import torch

        flat = w.float().reshape(w.shape[0], -1)
        lo, hi = flat.amin(dim=1, keepdim=True), flat.amax(dim=1, keepdim=True)
        scale = (hi - lo) / 255.0
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        zp = torch.clamp(torch.round(-lo / scale), 0, 255)
        q = torch.clamp(torch.round(flat / scale) + zp, 0, 255).to(torch.uint8).reshape(w.shape)
        shape = (w.shape[0],) + (1,) * (w.dim() - 1)
        return q, zp.to(torch.uint8).reshape(shape), scale.reshape(shape)


def _q_module(mod: Any) -> Any:
    """An 8-bit twin of a Linear or Conv2d (on meta; its buffers set as the weights stream in)."""
    import torch
    import torch.nn.functional as F

    conv = isinstance(mod, torch.nn.Conv2d)

    class QModule(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            shape = tuple(mod.weight.shape)
            lead = (shape[0],) + (1,) * (len(shape) - 1)
            self.register_buffer("qweight", torch.empty(shape, dtype=torch.uint8, device="meta"))
            self.register_buffer("zero_point", torch.empty(lead, dtype=torch.uint8, device="meta"))
            self.register_buffer("scale", torch.empty(lead, dtype=torch.float32, device="meta"))
            self.bias = None if mod.bias is None else torch.nn.Parameter(
                torch.empty(mod.bias.shape, device="meta"), requires_grad=False)
            if conv:
                self.stride, self.padding = mod.stride, mod.padding
                self.dilation, self.groups = mod.dilation, mod.groups

        def forward(self, x: Any) -> Any:
            w = (self.qweight.to(torch.float32) - self.zero_point.to(torch.float32)) * self.scale
            if conv:
                return F.conv2d(x, w, self.bias, self.stride, self.padding, self.dilation, self.groups)
            return F.linear(x, w, self.bias)

    return QModule()


def stream_int8_model(folder: Path) -> tuple[Any, int]:
    """The diffusers model in `folder` with every Linear and Conv2d in 8 bit, quantized as each
    tensor is read from the safetensors files; other tensors in float32. Returns (model, layers)."""
    import torch
    from diffusers import SanaTransformer2DModel
    from safetensors import safe_open

    with torch.device("meta"):
        model = SanaTransformer2DModel.from_config(SanaTransformer2DModel.load_config(folder))
    swapped = 0
    for _, mod in list(model.named_modules()):
        for child_name, child in list(mod.named_children()):
            if isinstance(child, (torch.nn.Linear, torch.nn.Conv2d)):
                setattr(mod, child_name, _q_module(child))
                swapped += 1
    modules = dict(model.named_modules())
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as fh:
            for key in fh.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                owner, _, attr = key.rpartition(".")
                mod = modules[owner]
                tensor = fh.get_tensor(key)
                if attr == "weight" and hasattr(mod, "qweight"):
                    q, zp, scale = _Int8Weights.quantize(tensor)
                    mod.qweight, mod.zero_point, mod.scale = q, zp, scale
                elif attr in mod._parameters:
                    mod._parameters[attr] = torch.nn.Parameter(tensor.float(), requires_grad=False)
                else:
                    mod._buffers[attr] = tensor.float()
                del tensor
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    for n in left:  # buffers computed at init (none expected in Sana), rebuilt on CPU
        raise RuntimeError(f"not in the safetensors: {n}")
    return model.eval(), swapped


def route_stream(src: Path, work: Path, phases: Phases) -> dict[str, Any]:
    """The transformer quantized to 8 bit as its tensors stream from disk, then converted."""
    import gc

    from tasks.common.memory import release_memory

    stage = work / "stream"
    shutil.rmtree(stage, ignore_errors=True)
    gc.freeze()
    phases.mark("load")
    pipe, _ = _pipeline(src, "vae")  # the transformer on meta, the VAE real, as in the other routes
    model, swapped = stream_int8_model(src / NAME)
    pipe.register_modules(transformer=model)
    models = _export_config_models(pipe)
    release_memory()
    _instrumented_convert(models, stage, False, phases)
    phases.mark("release_torch")
    del pipe, models, model
    release_memory()
    xml = stage / NAME / "openvino_model.xml"
    return {"layers_int8": swapped, "parity": _check_written(xml, work, phases, "check_int8"),
            "ir_mb": _sizes(xml.parent)}


# ---------------------------------------------------------------- stream_ext: the same, traced without computing
class QLinear8(__import__("torch").nn.Module):
    """A Linear with 8-bit weights (uint8, per-row zero point and scale) for the `stream_ext` route."""

    def __init__(self, mod: Any) -> None:
        super().__init__()
        self.out_features = mod.weight.shape[0]
        _meta_buffers(self, mod)

    def forward(self, x: Any) -> Any:
        import torch
        import torch.nn.functional as F

        w = (self.qweight.to(torch.float32) - self.zero_point.to(torch.float32)) * self.scale
        return F.linear(x, w.reshape(self.qweight.shape), self.bias)


class QConv1x1(QLinear8):
    """A 1x1, stride-1, unpadded, ungrouped Conv2d with 8-bit weights."""

    def forward(self, x: Any) -> Any:
        import torch
        import torch.nn.functional as F

        w = (self.qweight.to(torch.float32) - self.zero_point.to(torch.float32)) * self.scale
        return F.conv2d(x, w, self.bias)


def _meta_buffers(self: Any, mod: Any) -> None:
    import torch

    shape = tuple(mod.weight.shape)
    lead = (shape[0],) + (1,) * (len(shape) - 1)
    self.register_buffer("qweight", torch.empty(shape, dtype=torch.uint8, device="meta"))
    self.register_buffer("zero_point", torch.empty(lead, dtype=torch.uint8, device="meta"))
    self.register_buffer("scale", torch.empty(lead, dtype=torch.float32, device="meta"))
    self.bias = None if mod.bias is None else torch.nn.Parameter(torch.empty(mod.bias.shape, device="meta"),
                                                                 requires_grad=False)


def _ov_extensions() -> tuple[dict[Any, Any], list[Any]]:
    """ModuleExtensions that trace QLinear8/QConv1x1 as one custom op each without running them (a
    placeholder output, as OpenVINO's own 16-bit patch does for Linear), and the ConversionExtensions
    that turn each op into u8 constant -> Convert -> Subtract(zero point) -> Multiply(scale) ->
    MatMul/Convolution (+ bias): the decompression pattern OpenVINO keeps compressed."""
    import openvino as ov
    import openvino.opset13 as ops
    import torch
    from openvino.frontend.pytorch import ConversionExtension, ModuleExtension

    def placeholder_linear(module: Any, x: Any) -> Any:
        return torch.zeros((), dtype=torch.float32).expand(*x.shape[:-1], module.out_features).clone()

    def placeholder_conv(module: Any, x: Any) -> Any:
        return torch.zeros((), dtype=torch.float32).expand(x.shape[0], module.out_features, *x.shape[2:]).clone()

    def args(module: Any, x: Any) -> tuple[Any, ...]:
        extra = () if module.bias is None else (module.bias,)
        return (x, module.qweight, module.zero_point, module.scale) + extra

    modules = {
        QLinear8: ModuleExtension(QLinear8, "ov_ext::q8_linear",
                                  convert=lambda m, op, x, *a, **k: op(*args(m, x)),
                                  evaluate=lambda m, x, *a, **k: placeholder_linear(m, x)),
        QConv1x1: ModuleExtension(QConv1x1, "ov_ext::q8_conv1x1",
                                  convert=lambda m, op, x, *a, **k: op(*args(m, x)),
                                  evaluate=lambda m, x, *a, **k: placeholder_conv(m, x)),
    }

    def weight(ctx: Any) -> Any:
        q = ops.convert(ctx.get_input(1), ov.Type.f32)
        zp = ops.convert(ctx.get_input(2), ov.Type.f32)
        return ops.multiply(ops.subtract(q, zp), ctx.get_input(3))

    def linear(ctx: Any) -> list[Any]:
        out = ops.matmul(ctx.get_input(0), weight(ctx), False, True)
        if ctx.get_input_size() > 4:
            out = ops.add(out, ctx.get_input(4))
        return [out.output(0)]

    def conv(ctx: Any) -> list[Any]:
        out = ops.convolution(ctx.get_input(0), weight(ctx), [1, 1], [0, 0], [0, 0], [1, 1])
        if ctx.get_input_size() > 4:
            out = ops.add(out, ops.unsqueeze(ops.unsqueeze(ctx.get_input(4), ops.constant(1)), ops.constant(2)))
        return [out.output(0)]

    return modules, [ConversionExtension("ov_ext::q8_linear", linear), ConversionExtension("ov_ext::q8_conv1x1", conv)]


def _meta_model_with_q8_layers(folder: Path) -> tuple[Any, int]:
    """The transformer built on the meta device, its Linear and plain 1x1 Conv2d layers replaced by
    QLinear8 / QConv1x1 (depthwise and other convs stay float32); (model, layers replaced)."""
    import torch
    from diffusers import SanaTransformer2DModel

    with torch.device("meta"):
        model = SanaTransformer2DModel.from_config(SanaTransformer2DModel.load_config(folder))
    swapped = 0
    for _, mod in list(model.named_modules()):
        for child_name, child in list(mod.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(mod, child_name, QLinear8(child))
            elif (isinstance(child, torch.nn.Conv2d) and child.kernel_size == (1, 1) and child.stride == (1, 1)
                  and child.padding == (0, 0) and child.groups == 1 and child.dilation == (1, 1)):
                setattr(mod, child_name, QConv1x1(child))
            else:
                continue
            swapped += 1
    return model, swapped


def stream_int8_model_ext(folder: Path) -> tuple[Any, int]:
    """As stream_int8_model, with QLinear8 / QConv1x1 modules (depthwise and other convs stay float32)."""
    import torch
    from safetensors import safe_open

    model, swapped = _meta_model_with_q8_layers(folder)
    modules = dict(model.named_modules())
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as fh:
            for key in fh.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                owner, _, attr = key.rpartition(".")
                mod = modules[owner]
                tensor = fh.get_tensor(key)
                if attr == "weight" and hasattr(mod, "qweight"):
                    mod.qweight, mod.zero_point, mod.scale = _Int8Weights.quantize(tensor)
                elif attr in mod._parameters:
                    mod._parameters[attr] = torch.nn.Parameter(tensor.float(), requires_grad=False)
                else:
                    mod._buffers[attr] = tensor.float()
                del tensor
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"not in the safetensors: {left[:5]}")
    return model.eval(), swapped


def route_stream_ext_b1(src: Path, work: Path, phases: Phases) -> dict[str, Any]:
    """`stream_ext`, traced on a batch of 1 instead of optimum's default 2 (the IR's batch axis stays
    dynamic): tracing holds every intermediate activation until it ends, so its memory follows the
    example input's size."""
    from optimum import utils

    saved = dict(utils.DEFAULT_DUMMY_SHAPES)
    utils.DEFAULT_DUMMY_SHAPES["batch_size"] = 1
    try:
        return route_stream_ext(src, work, phases, stage_name="stream_ext_b1")
    finally:
        utils.DEFAULT_DUMMY_SHAPES.clear()
        utils.DEFAULT_DUMMY_SHAPES.update(saved)


def route_stream_ext(src: Path, work: Path, phases: Phases, stage_name: str = "stream_ext") -> dict[str, Any]:
    """`stream`, with the 8-bit layers traced as custom ops (nothing computed while tracing)."""
    import gc

    from tasks.common.memory import release_memory

    stage = work / stage_name
    shutil.rmtree(stage, ignore_errors=True)
    gc.freeze()
    phases.mark("load")
    pipe, _ = _pipeline(src, "vae")
    model, swapped = stream_int8_model_ext(src / NAME)
    pipe.register_modules(transformer=model)
    models = _export_config_models(pipe)
    module_ext, conversion_ext = _ov_extensions()
    _, export_config = models[NAME]
    orig_patch = export_config.patch_model_for_export

    def patch(*a: Any, **k: Any) -> Any:  # optimum reads these two attributes off the patcher
        patcher = orig_patch(*a, **k)
        patcher.module_extensions = {**(getattr(patcher, "module_extensions", None) or {}), **module_ext}
        patcher.conversion_extensions = [*(getattr(patcher, "conversion_extensions", None) or []), *conversion_ext]
        return patcher

    export_config.patch_model_for_export = patch
    release_memory()
    _instrumented_convert(models, stage, False, phases)
    phases.mark("release_torch")
    del pipe, models, model
    release_memory()
    xml = stage / NAME / "openvino_model.xml"
    return {"layers_int8": swapped, "parity": _check_written(xml, work, phases, "check_int8"),
            "ir_mb": _sizes(xml.parent)}


# ---------------------------------------------------------------- stream_lean: stream_ext_b1 without its leftovers
def read_safetensors(file: Path) -> Any:
    """(name, tensor) for each tensor of a safetensors file, read with plain file reads one at a time
    (no mapping: the pages read stay in the page cache, not in this process's RSS)."""
    import torch

    dtypes = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "I64": torch.int64,
              "I32": torch.int32, "U8": torch.uint8, "I8": torch.int8, "BOOL": torch.bool}
    with open(file, "rb") as fh:
        size = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(size))
        base = 8 + size
        for name, info in header.items():
            if name == "__metadata__":
                continue
            start, end = info["data_offsets"]
            fh.seek(base + start)
            buf = bytearray(fh.read(end - start))
            yield name, torch.frombuffer(buf, dtype=dtypes[info["dtype"]]).reshape(info["shape"]) if buf else \
                torch.empty(info["shape"], dtype=dtypes[info["dtype"]])


def stream_int8_model_lean(folder: Path) -> tuple[Any, int]:
    """stream_int8_model_ext's model, its tensors read by read_safetensors instead of safe_open."""
    import torch

    model, swapped = _meta_model_with_q8_layers(folder)
    modules = dict(model.named_modules())
    for file in sorted(folder.glob("*.safetensors")):
        for key, tensor in read_safetensors(file):
            owner, _, attr = key.rpartition(".")
            mod = modules[owner]
            if attr == "weight" and hasattr(mod, "qweight"):
                mod.qweight, mod.zero_point, mod.scale = _Int8Weights.quantize(tensor)
            elif attr in mod._parameters:
                mod._parameters[attr] = torch.nn.Parameter(tensor.float(), requires_grad=False)
            else:
                mod._buffers[attr] = tensor.float()
            del tensor
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"not in the safetensors: {left[:5]}")
    return model.eval(), swapped


def route_stream_lean_small(src: Path, work: Path, phases: Phases) -> dict[str, Any]:
    """stream_lean, traced on an 8x8 latent (7x7 after optimum's "-1") instead of the config's
    sample_size 32 (31x31): Sana 1.0 has no positional embedding, so the traced graph does not depend
    on it, and the IR's spatial axes stay dynamic."""
    return route_stream_lean(src, work, phases, stage_name="stream_lean_small", trace_size=8)


def route_stream_lean(src: Path, work: Path, phases: Phases, stage_name: str = "stream_lean",
                      trace_size: int | None = None) -> dict[str, Any]:
    """stream_ext_b1, with the VAE on the meta device too, the weights read without a mapping, and
    OpenVINO's module patch undone after conversion so the module is freed before the check."""
    import gc

    import diffusers
    import torch
    from openvino.frontend.pytorch.patch_model import unpatch_model
    from optimum import utils

    from tasks.common import families
    from tasks.common.memory import release_memory
    from tasks.export.components import _meta_model, _model_class

    stage = work / stage_name
    shutil.rmtree(stage, ignore_errors=True)
    gc.freeze()
    phases.mark("load")
    index = families.read_index(src)
    overrides = {name: _meta_model(src / name, _model_class(spec)) for name, spec in index.items()
                 if not name.startswith("_") and isinstance(spec, list) and spec[0] is not None
                 and _model_class(spec) is not None}
    pipe = getattr(diffusers, index["_class_name"]).from_pretrained(src, **overrides)
    model, swapped = stream_int8_model_lean(src / NAME)
    pipe.register_modules(transformer=model)
    models = _export_config_models(pipe)
    module_ext, conversion_ext = _ov_extensions()
    _, export_config = models[NAME]
    orig_patch = export_config.patch_model_for_export

    def patch(*a: Any, **k: Any) -> Any:
        patcher = orig_patch(*a, **k)
        patcher.module_extensions = {**(getattr(patcher, "module_extensions", None) or {}), **module_ext}
        patcher.conversion_extensions = [*(getattr(patcher, "conversion_extensions", None) or []), *conversion_ext]
        return patcher

    export_config.patch_model_for_export = patch
    if trace_size is not None:  # the dummy generator reads the normalized config's image_size
        object.__setattr__(export_config._normalized_config, "image_size", trace_size)
    release_memory()
    saved = dict(utils.DEFAULT_DUMMY_SHAPES)
    utils.DEFAULT_DUMMY_SHAPES["batch_size"] = 1
    try:
        _instrumented_convert(models, stage, False, phases)
    finally:
        utils.DEFAULT_DUMMY_SHAPES.clear()
        utils.DEFAULT_DUMMY_SHAPES.update(saved)
    phases.mark("release_torch")
    unpatch_model(model, "_openvino_module_extension_patch_orig_forward")
    export_config.patch_model_for_export = orig_patch
    # Something still holds the module after the patch is undone (the traced graph's custom ops
    # reference it; not found where); its tensors are emptied so that they go whoever holds it.
    for mod in model.modules():
        for store in (mod._parameters, mod._buffers):
            for key, value in list(store.items()):
                if value is not None:
                    store[key] = torch.empty(0, dtype=value.dtype)
    del pipe, models, model, export_config
    release_memory()
    xml = stage / NAME / "openvino_model.xml"
    return {"layers_int8": swapped, "parity": _check_written(xml, work, phases, "check_int8"),
            "ir_mb": _sizes(xml.parent)}


# ---------------------------------------------------------------- driver
def build_cut(out: Path, layers: int, full: Path, seed: int = 0) -> None:
    """`full`'s Sana 1600M pipeline with its transformer cut to `layers` of its 20 layers (same widths,
    seeded random weights in bf16); the other parts linked from `full`."""
    from diffusers import SanaTransformer2DModel

    from benchmarks.sana.build import SANA_1600M
    from benchmarks.sd35.build import _save

    if (out / NAME / "config.json").is_file():
        return
    out.mkdir(parents=True, exist_ok=True)
    for entry in full.iterdir():
        if entry.name != NAME and not (out / entry.name).exists():
            (out / entry.name).symlink_to(entry.resolve())
    _save(NAME, lambda: SanaTransformer2DModel(**{**SANA_1600M, "num_layers": layers}), out, seed)


def _watch(proc: subprocess.Popen, limit_mb: float) -> tuple[str | None, int, Any]:
    """Wait for `proc`, killing it when its RSS passes `limit_mb`: (why killed or None, status, rusage)."""
    killed = None
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            return killed, status, usage
        try:
            with open(f"/proc/{proc.pid}/status", encoding="ascii") as fh:
                rss = next(int(line.split()[1]) / 1024 for line in fh if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            rss = 0.0
        if rss > limit_mb and killed is None:
            proc.kill()
            killed = f"killed at {rss:.0f} MB RSS (limit {limit_mb:.0f} MB)"
        time.sleep(0.3)


def _child(route: str, src: Path, work: Path, out: Path) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    phases = Phases()
    start = time.perf_counter()
    fn = {"reference": route_reference, "today": route_today, "compress_first": route_compress_first,
          "stream": route_stream, "stream_ext": route_stream_ext,
          "stream_ext_b1": route_stream_ext_b1, "stream_lean": route_stream_lean,
          "stream_lean_small": route_stream_lean_small}[route]
    error = None
    try:
        result = fn(src, work, phases)
    except Exception as exc:  # a failing route is a result too
        log.exception("route %s failed", route)
        result, error = {}, f"{type(exc).__name__}: {exc}"
    phases.close()
    result.update({"route": route, "error": error, "seconds": round(time.perf_counter() - start, 1),
                   "phases": phases.rows,
                   "ru_maxrss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                   "timeline_anon_file_mb": phases.timeline[::5]})
    out.write_text(json.dumps(result, indent=1))


def _machine() -> dict[str, Any]:
    import nncf
    import openvino
    import torch

    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "")
    flags = next((line for line in cpuinfo if line.startswith("flags")), "")
    return {"cpu": model, "cores": os.cpu_count(), "amx_bf16": "amx_bf16" in flags,
            "avx512_bf16": "avx512_bf16" in flags,
            "mem_total_gb": round(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2 ** 30, 1),
            "allocator": os.environ.get("LD_PRELOAD", "glibc malloc"),
            "python": platform.python_version(), "torch": torch.__version__, "openvino": openvino.__version__,
            "nncf": nncf.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--route", choices=("all",) + ROUTES, default="all")
    parser.add_argument("--model", type=Path, default=Path(".cache/bench/sana-1600m"))
    parser.add_argument("--layers", type=int, help="cut the transformer to this many of its 20 layers "
                        "(built beside --model as <model>-<n>l)")
    parser.add_argument("--limit-mb", type=float, default=15000, help="kill a route past this RSS")
    parser.add_argument("--work", type=Path, default=Path(".cache/bench/memory-routes"))
    parser.add_argument("--results", type=Path, default=Path(__file__).with_name("results_memory_routes.json"))
    parser.add_argument("--child", choices=("reference",) + ROUTES, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.model, args.work, args.child_out)
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.layers:
        cut = args.model.with_name(f"{args.model.name}-{args.layers}l")
        build_cut(cut, args.layers, args.model)
        args.model = cut
    args.work.mkdir(parents=True, exist_ok=True)
    results = json.loads(args.results.read_text()) if args.results.is_file() else {}
    results["machine"] = _machine()
    weights = sum(p.stat().st_size for p in (args.model / NAME).glob("*.safetensors"))
    results["model"] = {"folder": str(args.model), "component": NAME, "layers": args.layers or 20,
                        "bf16_weights_mb": round(weights / 2 ** 20, 1)}
    todo = ([] if (args.work / "reference.npz").is_file() else ["reference"]) + \
        (list(ROUTES) if args.route == "all" else [args.route])
    for route in todo:
        out = args.work / f"{route}.json"
        cmd = [sys.executable, "-m", "benchmarks.export.memory_routes", "--child", route, "--model", str(args.model),
               "--work", str(args.work), "--child-out", str(out)]
        log.info("route %s: %s", route, " ".join(cmd))
        start = time.perf_counter()
        out.unlink(missing_ok=True)
        proc = subprocess.Popen(cmd)
        killed, status, usage = _watch(proc, args.limit_mb)
        entry = (json.loads(out.read_text()) if out.is_file()
                 else {"route": route, "error": killed or f"exit status {status}"})
        entry["wall_s"] = round(time.perf_counter() - start, 1)
        # ru_maxrss is the kernel's high-water mark, which each phase's clear_refs resets: the last
        # stretch's peak only. The route's peak is its largest phase's.
        entry["peak_rss_mb"] = max((p["peak_rss_mb"] for p in entry.get("phases", [])), default=None)
        entry["ru_maxrss_after_resets_mb"] = round(usage.ru_maxrss / 1024, 1)
        entry.pop("process_ru_maxrss_mb", None)
        entry.pop("ru_maxrss_mb", None)
        entry["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        results.setdefault("routes", {})[route] = entry
        args.results.write_text(json.dumps(results, indent=1))
        log.info("route %s: peak %s MB, %.0f s", route, entry["peak_rss_mb"], entry["wall_s"])


if __name__ == "__main__":
    main()
