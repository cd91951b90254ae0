"""Training on CPUs: Intel Extension for PyTorch where it can run, PyTorch's own bf16 autocast otherwise.

`train.cpu_backend` picks the path, and the log says which one ran:

- `ipex`: `ipex.optimize` on every module, as in the Intel CPU fine-tuning write-up: the frozen
  ones (VAE, text encoders) for inference in the run's precision (`dtype=torch.bfloat16` with
  `mixed_precision: bf16`), the trained ones together with the optimizer (IPEX's fused update
  step) in float32, and bf16 autocast runs their forward and backward in bf16. Trained weights stay
  float32 on purpose: IPEX's bf16 training keeps bf16 weights in the modules and the float32
  master weights inside the optimizer, so checkpoints, the EMA and the saved pipeline would hold
  bf16-rounded weights (for LoRA even the frozen base weights it fuses into).
- `native`: no extension; accelerate's autocast runs bf16 on the CPU when `mixed_precision: bf16`.
- `auto` (default): `ipex` when intel_extension_for_pytorch is installed, its version matches
  torch's (it supports exactly one torch minor release, and refuses to load with another) and it
  imports; otherwise `native`, with the reason in the log.

`train.torch_compile` compiles the UNet on top of either path.
"""
from __future__ import annotations

import importlib.metadata
import logging
from typing import Any

import torch

from tasks.common.errors import UserError
from tasks.train.backend_base import Backend
from tasks.train.config import TrainConfig

log = logging.getLogger(__name__)

IPEX = "intel_extension_for_pytorch"


def _minor(version: str) -> tuple[str, ...]:
    return tuple(version.split("+")[0].split(".")[:2])


def ipex_status() -> tuple[Any | None, str]:
    """(the imported module or None, why). Never imports an IPEX built for another torch: it would exit."""
    try:
        version = importlib.metadata.version(IPEX)
    except importlib.metadata.PackageNotFoundError:
        return None, f"{IPEX} is not installed"
    if _minor(version) != _minor(torch.__version__):
        return None, (f"{IPEX} {version} runs only with torch {'.'.join(_minor(version))}.x, "
                      f"this is torch {torch.__version__}")
    try:
        import intel_extension_for_pytorch as ipex
    except (ImportError, OSError, RuntimeError, SystemExit) as err:
        return None, f"{IPEX} {version} does not import: {err}"
    return ipex, f"{IPEX} {version} with torch {torch.__version__}"


class NativeCpuBackend(Backend):
    """PyTorch alone: accelerate's autocast does bf16 when asked."""

    name = "native"

    def __init__(self, cfg: TrainConfig, mixed_precision: str, why: str) -> None:
        super().__init__(cfg)
        self.mixed_precision = mixed_precision
        self.why = why

    def prepare(self, method: Any, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        precision = ("torch bf16 autocast" if self.mixed_precision == "bf16"
                     else "float32 (train.mixed_precision: auto for bf16 autocast where the CPU has native bf16)")
        log.info("CPU back end: native, %s%s (%s)", precision, ", torch.compile" if self.cfg.torch_compile else "",
                 self.why)
        return super().prepare(method, optimizer)


class IpexBackend(Backend):
    """`ipex.optimize` on the trained modules with the optimizer, and on the frozen ones for inference."""

    name = "ipex"

    def __init__(self, cfg: TrainConfig, mixed_precision: str, ipex: Any, why: str) -> None:
        super().__init__(cfg)
        self.ipex = ipex
        self.dtype = torch.bfloat16 if mixed_precision == "bf16" else torch.float32  # of the frozen modules
        self.why = why

    def prepare(self, method: Any, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        modules, trainable = method.components.modules, method.trainable()
        frozen = [n for n in modules if n not in trainable]
        for name in frozen:  # inference optimisations; in place, so every holder of the module sees them
            self.ipex.optimize(modules[name].eval(), dtype=self.dtype, inplace=True)
        # One call for all trained modules: ipex.optimize takes one model with its optimizer. No weight
        # prepacking for them: prepacked (blocked) weights would be what checkpoints and the saved
        # pipeline contain, in a layout nothing else can load.
        together = torch.nn.ModuleDict({n: modules[n] for n in trainable})
        _, optimizer = self.ipex.optimize(together, optimizer=optimizer, dtype=torch.float32, inplace=True,
                                          weights_prepack=False)
        log.info("CPU back end: ipex, ipex.optimize(%s with the optimizer, float32 weights; %s for inference, "
                 "dtype=%s)%s%s (%s)",
                 ", ".join(trainable), ", ".join(frozen) or "nothing", str(self.dtype).removeprefix("torch."),
                 " + bf16 autocast" if self.dtype == torch.bfloat16 else "",
                 ", torch.compile" if self.cfg.torch_compile else "", self.why)
        self.compile(method.components.denoiser)
        return optimizer


def choose_cpu_backend(cfg: TrainConfig, mixed_precision: str) -> Backend:
    """The path `train.cpu_backend` asks for; `ipex` fails with the fix when IPEX cannot run here."""
    if cfg.cpu_backend == "native":
        return NativeCpuBackend(cfg, mixed_precision, "train.cpu_backend: native")
    if mixed_precision == "bf16" and cfg.bf16_weights("cpu"):
        return NativeCpuBackend(cfg, mixed_precision, "full_bf16: the weights are bf16 already")
    ipex, why = ipex_status()
    if ipex is not None:
        return IpexBackend(cfg, mixed_precision, ipex, why)
    if cfg.cpu_backend == "ipex":
        raise UserError(f"train.cpu_backend is ipex but {why}. Install the matching pair (make side-envs builds "
                        ".venv-ipex with torch 2.8 and intel_extension_for_pytorch 2.8), or set train.cpu_backend: "
                        "auto or native")
    return NativeCpuBackend(cfg, mixed_precision, f"auto: {why}")
