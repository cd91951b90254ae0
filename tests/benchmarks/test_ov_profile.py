"""benchmarks/export/ov_profile.py: the FLOP count, the profile breakdown and the GEMM peaks the
int8 study's bound is computed from."""
from __future__ import annotations

import numpy as np
import pytest

from benchmarks.export import ov_profile

pytestmark = pytest.mark.quick  # make test-fast


def _conv_matmul_model():
    import openvino as ov
    import openvino.opset13 as ops

    rng = np.random.default_rng(0)
    x = ops.parameter([2, 8, 16, 16], np.float32, name="x")
    conv = ops.convolution(x, ops.constant(rng.standard_normal((16, 8, 3, 3)).astype(np.float32)),
                           [1, 1], [1, 1], [1, 1], [1, 1])  # -> [2, 16, 16, 16]
    tokens = ops.reshape(conv, ops.constant(np.array([2, 16, 256], np.int64)), False)
    mm = ops.matmul(tokens, ops.constant(rng.standard_normal((256, 32)).astype(np.float32)), False, False)
    return ov.Model([mm], [x]), {"x": rng.standard_normal((2, 8, 16, 16)).astype(np.float32)}


def test_flops_count_each_multiply_add_twice() -> None:
    model, _ = _conv_matmul_model()
    conv = 2 * (2 * 16 * 16 * 16) * (8 * 3 * 3)
    matmul = 2 * (2 * 16 * 32) * 256
    assert ov_profile.gemm_flops(model) == {"conv_matmul": conv + matmul, "attention": 0.0}


def test_profile_splits_matrix_products_from_the_rest() -> None:
    import openvino as ov

    model, inputs = _conv_matmul_model()
    profile = ov_profile.profile_model(ov.Core(), model, inputs, {"INFERENCE_PRECISION_HINT": "f32"})
    assert profile["gemm_ms"] > 0 and profile["total_ms"] >= profile["gemm_ms"]
    assert profile["gemm_ms_by_precision"].keys() == {"F32"}
    kinds = profile["gemm_nodes_by_kind_precision"]
    assert kinds.get("Convolution:F32") == 1 and sum(kinds.values()) == 2


@pytest.mark.parametrize("int8", [False, True])
def test_the_gemm_peak_runs_the_precision_it_names(int8: bool) -> None:
    import openvino as ov

    peak = ov_profile.gemm_peak_gflops(ov.Core(), int8, n=256, calls=2)
    assert peak["gflops"] > 0
    precisions = {ov_profile.precision_of(k) for k in peak["kernels"]}
    if int8:
        assert precisions == {"I8"}
    else:  # bf16 where the CPU has it, else the plugin falls back to f32
        assert precisions <= {"BF16", "F32"} and precisions
