"""The CPU's native formats (finetune_runtime/cpu_formats.py) and the precision `auto` picks from them,
with the flags faked both ways: a CPU with AMX/AVX-512 BF16, and an AVX2-only one that emulates bf16."""
from __future__ import annotations

import pytest
import torch

from finetune_runtime import cpu_formats as C

AMX = ["avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "amx_int8", "avx512_fp16", "avx512_vnni"]
AVX2 = ["avx", "avx2", "fma", "f16c"]  # AMD EPYC Rome/Milan, Intel Xeon before Cooper Lake


def test_the_flags_name_the_native_formats() -> None:
    amx, avx2 = C.detect(AMX, "AVX512"), C.detect(AVX2, "AVX2")
    assert amx.bf16 and amx.vector == "AVX512"
    assert amx.native == ["AMX-BF16", "AVX512-BF16", "AVX512-FP16", "AMX-INT8", "AVX512-VNNI"]
    assert not avx2.bf16 and avx2.native == [] and avx2.describe() == "AVX2"
    assert C.detect(["avx2", "avx_vnni"], "AVX2").describe() == "AVX2 with AVX-VNNI"
    assert not C.detect(["avx2", "avx_vnni"], "AVX2").bf16, "VNNI is int8, not bf16"
    assert C.detect(["asimd", "sve", "bf16"], "SVE256").bf16, "Arm's BF16 extension"
    assert not C.detect([], "DEFAULT").bf16 and C.detect([], "DEFAULT").vector == "DEFAULT", "no flags: not native"


def test_auto_is_bf16_only_where_native() -> None:
    native = C.auto_bf16(C.detect(AMX, "AVX512"))
    assert native.precision == "bf16" and "natively" in native.why and "AMX-BF16" in native.why
    emulated = C.auto_bf16(C.detect(AVX2, "AVX2"))
    assert emulated.precision == "fp32"
    assert emulated.line() == ("precision: fp32 (auto: this CPU has no native bf16 (AVX2); bf16 would be emulated, "
                               "about 500x slower than fp32)")


def test_an_explicit_bf16_on_an_emulating_cpu_is_refused_with_the_cost_and_the_fix() -> None:
    assert C.emulated_bf16_problem("class_images.precision", "class_images.precision: auto",
                                   C.detect(AMX, "AVX512")) is None
    problem = C.emulated_bf16_problem("class_images.precision", "class_images.precision: auto or fp32",
                                      C.detect(AVX2, "AVX2"))
    assert problem == (
        "class_images.precision: bf16 on a CPU without native bf16 (AVX2: neither AVX512-BF16 nor AMX-BF16): "
        "PyTorch would emulate it, about 500x slower than fp32 (a 2048x2048 matmul: 0.3 GFLOP/s in bf16 against "
        "155 in fp32, measured on an AVX2-only AMD EPYC). Set class_images.precision: auto or fp32.")


def test_a_16_bit_store_computes_in_bf16_only_where_it_is_native() -> None:
    amx, avx2 = C.detect(AMX, "AVX512"), C.detect(AVX2, "AVX2")
    for stored in (torch.bfloat16, torch.float16):
        assert C.compute_dtype(stored, amx) == torch.bfloat16
        assert C.compute_dtype(stored, avx2) == torch.float32
        assert C.compute_dtype(stored, avx2, device_type="cuda") == torch.bfloat16
    assert C.compute_dtype(torch.float32, amx) == torch.float32


def test_the_environment_fakes_the_flags(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv(C.FLAGS_ENV, "avx, avx2 FMA")
    assert C.read_flags() == {"avx", "avx2", "fma"} and not C.detect().bf16
    monkeypatch.setenv(C.FLAGS_ENV, " ".join(AMX))
    assert C.detect().bf16
    monkeypatch.delenv(C.FLAGS_ENV)
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu avx avx2 fma\n\n"
                       "processor\t: 1\nflags\t\t: fpu avx avx2 fma\n")
    assert C.read_flags(cpuinfo) == {"fpu", "avx", "avx2", "fma"}
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd sve bf16\n")
    assert C.read_flags(arm) == {"fp", "asimd", "sve", "bf16"}
    assert C.read_flags(tmp_path / "missing") == frozenset()


@pytest.mark.skipif(not C.CPUINFO.is_file(),
                    reason="no /proc/cpuinfo (not Linux): the real read is untested, the faked flags still are")
def test_this_cpu_as_read(monkeypatch) -> None:
    """The real read: the flags' vector ISA is the one torch dispatches to (torch's own CPU probe)."""
    monkeypatch.delenv(C.FLAGS_ENV, raising=False)
    formats = C.detect()
    assert formats.flags, "/proc/cpuinfo has a flags line"
    assert formats.capability.startswith(formats.vector) or formats.capability == "DEFAULT", formats


def test_a_referenced_quantized_base_serves_in_bf16_only_where_native(monkeypatch) -> None:
    """The served model's referenced base, quantized as it loads (base_reference.quantization)."""
    from finetune_runtime import base_reference

    monkeypatch.setenv(C.FLAGS_ENV, " ".join(AMX))
    assert base_reference.quantization({"transformer": "int8"})["torch_dtype"] == torch.bfloat16
    monkeypatch.setenv(C.FLAGS_ENV, " ".join(AVX2))
    assert base_reference.quantization({"transformer": "int8"})["torch_dtype"] == torch.float32
    assert base_reference.quantization({"transformer": "none"}) == {}, "nothing quantized: the stored dtype"
