"""The side-by-side training benchmarks pick both sides' compute precision from the CPU, as the train
stage's `auto` does: bf16 where it is native, fp32 where PyTorch emulates it (benchmarks/steptimer.py)."""
from __future__ import annotations

import pytest
import yaml

from benchmarks.steptimer import compute_precision, mixed_precision
from benchmarks.train.vs_diffusers import METHODS, ours_command
from finetune_runtime.cpu_formats import FLAGS_ENV

pytestmark = pytest.mark.quick


@pytest.mark.parametrize("flags, expected", [("avx2 fma", "fp32"), ("avx512f avx512_bf16", "bf16"),
                                             ("avx512f amx_bf16 amx_tile", "bf16")])
def test_auto_follows_the_cpu(monkeypatch: pytest.MonkeyPatch, flags: str, expected: str) -> None:
    monkeypatch.setenv(FLAGS_ENV, flags)
    assert compute_precision("auto") == expected
    assert compute_precision("bf16") == "bf16" and compute_precision("fp32") == "fp32"  # asked: as asked


def test_an_avx2_cpu_runs_our_stage_in_fp32(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv(FLAGS_ENV, "avx2 fma")
    compute = compute_precision("auto")
    assert mixed_precision(compute) == "no" and mixed_precision("bf16") == "bf16"
    data = {"instance": tmp_path / "i", "class": tmp_path / "c"}
    ours_command(METHODS["lora"], tmp_path / "base", tmp_path, data, 256, 6, "ours", compute)
    assert yaml.safe_load((tmp_path / "params.yaml").read_text())["train"]["mixed_precision"] == "no"
