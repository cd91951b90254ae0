"""Where an OpenVINO model's time goes: per-op profile, matrix-product FLOPs, measured GEMM peaks.

Used by benchmarks/export/int8_study.py. The CPU plugin's profile (`PERF_COUNT`) names, for each
executed node, its kind (`Convolution`, `FullyConnected`, `Reorder`, `Eltwise`, ...) and the kernel
it ran (`brgconv_avx512_amx_I8`, `brgemm_avx512_amx_BF16`, `jit_avx512_FP32`, ...): the kernel's
suffix is the precision it computed in.
"""
from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import numpy as np

#: Node kinds of the CPU plugin's profile that are matrix products (the ops 8-bit can speed up);
#: a kind counts when it starts with one of these (`FullyConnectedQuantizedLegacy`, ...).
GEMM_KINDS = ("Convolution", "FullyConnected", "MatMul", "ScaledDotProductAttention", "Deconvolution")


def is_gemm(kind: str) -> bool:
    return kind.startswith(GEMM_KINDS)


def _dims(port: Any) -> list[int]:
    return [d.get_length() for d in port.get_partial_shape()]


def gemm_flops(model: Any) -> dict[str, float]:
    """Floating-point operations of one call of a static-shape model's matrix products (2 per
    multiply-add), by kind: convolutions and MatMuls (`conv_matmul`), and scaled dot-product
    attention (`attention`: the CPU plugin runs it as a fused subgraph, not as a GEMM node)."""
    total = {"conv_matmul": 0.0, "attention": 0.0}
    for op in model.get_ops():
        kind = op.get_type_name()
        if kind == "Convolution":
            out = _dims(op.output(0))
            weight = _dims(op.input(1))  # [C_out, C_in, kh, kw]
            total["conv_matmul"] += 2.0 * np.prod(out) * np.prod(weight[1:])
        elif kind == "MatMul":
            a = _dims(op.input(0))
            k = a[-2] if op.get_attributes().get("transpose_a") else a[-1]
            total["conv_matmul"] += 2.0 * np.prod(_dims(op.output(0))) * k
        elif kind == "ScaledDotProductAttention":
            q, key = _dims(op.input(0)), _dims(op.input(1))  # [B, H, L, D], [B, H, S, D]
            total["attention"] += 2.0 * 2.0 * np.prod(q) * key[-2]  # Q K^T and P V
    return total


def time_calls(request: Any, inputs: dict[str, Any], calls: int) -> list[float]:
    """Seconds of each of `calls` synchronous inferences, after one untimed warm-up."""
    request.infer(inputs)
    out = []
    for _ in range(calls):
        start = time.perf_counter()
        request.infer(inputs)
        out.append(time.perf_counter() - start)
    return out


def precision_of(exec_type: str) -> str:
    """The precision suffix of a CPU kernel name ('brgconv_avx512_amx_I8' -> 'I8')."""
    tail = exec_type.rsplit("_", 1)[-1].upper()
    return tail if tail in {"I8", "U8", "BF16", "F16", "F32", "I32", "I64"} else "other"


def breakdown(profile: list[Any]) -> dict[str, Any]:
    """Executed nodes' time (ms) by node kind, by kernel precision, and for the matrix products by
    precision; plus the share of the total in matrix products, reorders and quantize ops."""
    by_kind: dict[str, float] = defaultdict(float)
    by_precision: dict[str, float] = defaultdict(float)
    gemm_by_precision: dict[str, float] = defaultdict(float)
    gemm_count: dict[str, int] = defaultdict(int)
    attention = 0.0
    for info in profile:
        if str(info.status).endswith("NOT_RUN"):
            continue
        ms = info.real_time.total_seconds() * 1e3
        precision = precision_of(info.exec_type)
        by_kind[info.node_type] += ms
        if "scaled_dot_product_attention" in info.node_name:
            attention += ms
        by_precision[precision] += ms
        if is_gemm(info.node_type):
            gemm_by_precision[precision] += ms
            gemm_count[f"{info.node_type}:{precision}"] += 1
    total = sum(by_kind.values())
    gemm = sum(gemm_by_precision.values())

    def share(ms: float) -> float:
        return round(100 * ms / total, 1) if total else 0.0

    def rounded(d: dict[str, float]) -> dict[str, float]:
        return {k: round(v, 1) for k, v in sorted(d.items(), key=lambda kv: -kv[1])}

    return {
        "total_ms": round(total, 1),
        "gemm_ms": round(gemm, 1),
        "non_gemm_ms": round(total - gemm, 1),
        "attention_ms": round(attention, 1),  # the fused attention subgraphs (in non_gemm_ms)
        "attention_pct": share(attention),
        "gemm_pct": share(gemm),
        "reorder_pct": share(by_kind.get("Reorder", 0.0)),
        "quantize_pct": share(by_kind.get("FakeQuantize", 0.0)),
        "gemm_ms_by_precision": rounded(gemm_by_precision),
        "gemm_nodes_by_kind_precision": dict(sorted(gemm_count.items())),
        "ms_by_precision": rounded(by_precision),
        "ms_by_kind": rounded(by_kind),
    }


def profile_model(core: Any, model: Any, inputs: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """Compile `model` with the CPU plugin's per-node counters on and break one call down."""
    compiled = core.compile_model(model, "CPU", {**config, "PERF_COUNT": True})
    request = compiled.create_infer_request()
    request.infer(inputs)
    request.infer(inputs)
    return breakdown(request.profiling_info)


def gemm_peak_gflops(core: Any, int8: bool, n: int = 2048, calls: int = 10) -> dict[str, Any]:
    """Measured throughput of one n x n x n matrix product through the CPU plugin, in bf16
    (the inference precision `auto` picks on CPUs with native bf16) or in 8 bit (both operands
    quantized by NNCF): the best this CPU's matrix units
    reach through OpenVINO, the figure the bound is computed with. The kernel is read back."""
    import openvino as ov
    import openvino.opset13 as ops

    rng = np.random.default_rng(0)
    x = ops.parameter([n, n], np.float32, name="x")
    w = ops.constant(rng.standard_normal((n, n)).astype(np.float32))
    model = ov.Model([ops.matmul(x, w, False, True)], [x])
    data = {"x": rng.standard_normal((n, n)).astype(np.float32)}
    if int8:  # quantized as NNCF quantizes the UNet's MatMuls (8-bit weights and input)
        import nncf

        model = nncf.quantize(model, nncf.Dataset([data]), subset_size=1, fast_bias_correction=True)
    compiled = core.compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "bf16", "PERF_COUNT": True})
    request = compiled.create_infer_request()
    seconds = min(time_calls(request, data, calls))
    kernels = sorted({i.exec_type for i in request.profiling_info if is_gemm(i.node_type)})
    return {"n": n, "gflops": round(2.0 * n**3 / seconds / 1e9, 1), "kernels": kernels}
