"""What this CPU computes natively, and the precision `auto` picks from it: the one place that knows.

bf16 is native where the CPU has AVX-512 BF16 or AMX-BF16 (Intel Cooper Lake, Sapphire Rapids and
later; AMD Zen 4 and later), or Arm's BF16 extension. Elsewhere PyTorch emulates it: on an AMD EPYC
with AVX2 only (EPYC Rome and Milan; every Intel Xeon before Cooper Lake is the same), a 2048x2048
matmul ran at 0.3 GFLOP/s in bf16 against 155 in fp32, about 500 times slower, and a 3x3
convolution (320 channels, 32 px) took 2.7 s against 0.018 s, the same under bf16 autocast.

So `auto` (train.mixed_precision, class_images.precision, the compute dtype of a bf16-stored or
quantized base in class images, evaluate and the export's references, the served model's referenced
base) means bf16 only where it is native and fp32 where it is not; an explicit bf16 on a CPU that
emulates it is refused before anything loads (`emulated_bf16_problem`), naming the key, the cost and
the fix. Every stage that decides logs one line naming the choice and why (`Choice.line`).

The flags come from /proc/cpuinfo (`flags` on x86, `Features` on Arm); the widest vector ISA
PyTorch dispatches to from `torch.backends.cpu.get_cpu_capability()`. `FINETUNE_CPU_FLAGS`
(space- or comma-separated, e.g. `avx2 fma`) replaces the flags read, for tests or a VM that hides
them. This module imports nothing of the stages (the served model uses it too).
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FLAGS_ENV = "FINETUNE_CPU_FLAGS"
CPUINFO = Path("/proc/cpuinfo")

#: The CPU flags (as /proc/cpuinfo names them) of native low-precision formats, and their names.
NATIVE_FORMATS = {
    "amx_bf16": "AMX-BF16", "avx512_bf16": "AVX512-BF16", "bf16": "BF16 (Arm)",
    "amx_fp16": "AMX-FP16", "avx512_fp16": "AVX512-FP16",
    "amx_int8": "AMX-INT8", "avx_vnni": "AVX-VNNI", "avx512_vnni": "AVX512-VNNI",
}
#: The flags whose presence makes bf16 matmuls and convolutions native (oneDNN's bf16 kernels).
BF16_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")
#: What emulated bf16 costs, as measured (issue 61: AMD EPYC, AVX2 only, torch 2.15).
SLOWDOWN = "about 500x slower than fp32"
EMULATED_COST = (f"{SLOWDOWN} (a 2048x2048 matmul: 0.3 GFLOP/s in bf16 against 155 in fp32, measured on an "
                 "AVX2-only AMD EPYC)")


def read_flags(cpuinfo: Path = CPUINFO) -> frozenset[str]:
    """The CPU's flags: FINETUNE_CPU_FLAGS when set, else /proc/cpuinfo's first `flags`/`Features`
    line (empty where there is none, e.g. macOS: no bf16 is then assumed native)."""
    if (fake := os.environ.get(FLAGS_ENV)) is not None:
        return frozenset(fake.replace(",", " ").lower().split())
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name.strip().lower() in ("flags", "features"):
                    return frozenset(value.lower().split())
    except OSError:
        pass
    return frozenset()


def torch_capability() -> str:
    """The widest vector ISA PyTorch dispatches to here (AVX2, AVX512, SVE256, DEFAULT...)."""
    import torch

    return str(torch.backends.cpu.get_cpu_capability())


@dataclass(frozen=True)
class CpuFormats:
    """A CPU's vector ISA (from its flags, else torch's capability) and native low-precision formats."""

    flags: frozenset[str]
    known_capability: str | None = None  # None: asked of torch when needed (the flags alone import nothing)

    @property
    def capability(self) -> str:
        """torch.backends.cpu.get_cpu_capability(), unless given."""
        return self.known_capability if self.known_capability is not None else torch_capability()

    @property
    def vector(self) -> str:
        """AVX512, AVX2, AVX, SVE, NEON from the flags; torch's capability where they say none."""
        for flag, name in (("avx512f", "AVX512"), ("avx2", "AVX2"), ("avx", "AVX"), ("sve", "SVE"),
                           ("asimd", "NEON")):
            if flag in self.flags:
                return name
        return self.capability

    @property
    def native(self) -> list[str]:
        """The native formats' names (NATIVE_FORMATS' order)."""
        return [name for flag, name in NATIVE_FORMATS.items() if flag in self.flags]

    @property
    def bf16(self) -> bool:
        """Whether bf16 matmuls and convolutions run natively."""
        return any(flag in self.flags for flag in BF16_FLAGS)

    def describe(self) -> str:
        """`AVX512 with AMX-BF16, AVX512-BF16, ...`, or `AVX2`."""
        native = self.native
        return f"{self.vector} with {', '.join(native)}" if native else self.vector

    def report(self) -> dict[str, Any]:
        """For reports and tags: the vector ISA, torch's capability, the native formats, bf16 native."""
        return {"vector": self.vector, "torch_capability": self.capability, "native": self.native,
                "bf16_native": self.bf16}


def detect(flags: Iterable[str] | None = None, capability: str | None = None) -> CpuFormats:
    """This CPU's formats (`flags`/`capability` given: those, for tests)."""
    return CpuFormats(frozenset(f.lower() for f in flags) if flags is not None else read_flags(), capability)


@dataclass(frozen=True)
class Choice:
    """A precision a stage computes in (`bf16`, `fp32`, `fp16`) and why, for its log line and report."""

    precision: str
    why: str

    def line(self, what: str = "precision") -> str:
        """`precision: fp32 (auto: this CPU has no native bf16: AVX2)`: the stage's one log line."""
        return f"{what}: {self.precision} ({self.why})"

    def report(self) -> dict[str, str]:
        return {"precision": self.precision, "why": self.why}


def auto_bf16(formats: CpuFormats | None = None, key: str = "auto") -> Choice:
    """On a CPU: bf16 where it is native, fp32 where it would be emulated."""
    formats = formats or detect()
    if formats.bf16:
        return Choice("bf16", f"{key}: this CPU computes bf16 natively: {formats.describe()}")
    return Choice("fp32", f"{key}: this CPU has no native bf16 ({formats.describe()}); bf16 would be emulated, "
                          f"{SLOWDOWN}")


def emulated_bf16_problem(key: str, fix: str, formats: CpuFormats | None = None) -> str | None:
    """The refusal of an explicit bf16 (`key`: bf16) computed on a CPU that emulates it, naming the
    cost and `fix` (the key's values that run natively); None where bf16 is native."""
    formats = formats or detect()
    if formats.bf16:
        return None
    return (f"{key}: bf16 on a CPU without native bf16 ({formats.describe()}: neither AVX512-BF16 nor AMX-BF16): "
            f"PyTorch would emulate it, {EMULATED_COST}. Set {fix}.")


def compute_dtype(stored: Any, formats: CpuFormats | None = None, device_type: str = "cpu") -> Any:
    """The dtype a model stored in `stored` computes in: bf16 for a bf16 or fp16 store where the device
    computes bf16 natively (a GPU, or a CPU with native bf16), else float32."""
    import torch

    if stored not in (torch.bfloat16, torch.float16):
        return torch.float32
    if device_type != "cpu":
        return torch.bfloat16
    return torch.bfloat16 if (formats or detect()).bf16 else torch.float32
