"""Precision and memory: autocast, bf16 weights, a quantized base and text encoders, gradient
checkpointing, the latent and text caches (in memory or on disk), the memory format."""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from finetune_runtime.cpu_formats import Choice, CpuFormats, auto_bf16, detect, emulated_bf16_problem
from tasks.common.config import StageConfig
from tasks.common.errors import UserError
from tasks.common.quantize import BasePrecision
from tasks.train.method_specs import method_spec, names_training


def cxx_compiler() -> str | None:
    """The C++ compiler torch.compile's CPU code needs (inductor's: $CXX, else g++), or None."""
    return shutil.which(os.environ.get("CXX") or "g++")


class PrecisionSection(StageConfig):
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = Field(
        "no", description="auto | no | bf16 (autocast) | fp16 (CUDA only); auto: bf16 on a CPU that computes it "
                          "natively (AVX512-BF16 or AMX-BF16), fp32 on one that would emulate it (AVX2 only: "
                          "~500x slower) and on a GPU; bf16 on a CPU that emulates it is refused "
                          "(finetune_runtime/cpu_formats.py)"
    )
    full_bf16: bool | None = Field(
        None, description="hold the weights dreambooth and full train in bf16, updated by AdamW in float32 with "
                          "stochastic rounding (kohya's --full_bf16): no float32 weights or gradients; null: "
                          "on for those methods on a CPU with mixed_precision bf16 (tasks/train/README.md)")
    allow_tf32: bool = Field(False, description="TF32 matmuls on Ampere+ GPUs")
    # a quantized frozen base (QLoRA)
    base_model_precision: str = Field(
        "none", description="none | int8 | fp8 | nf4, or with a library: int8-quanto, int8-bnb, fp8-quanto "
                            "(the denoiser's Linear layers quantized as they load; lora and textual_inversion)")
    text_encoder_precision: str = Field(
        "none", description="the frozen text encoders quantized as they load, while they build the text cache "
                            "(CLIP, T5-XXL): none | int8 (torchao)")
    # memory
    gradient_checkpointing: bool = Field(False, description="trade compute for memory in the UNet")
    # caches
    cache_latents: bool = Field(True, description="encode each image once (off by itself with random crops)")
    cache_text_encoder_outputs: bool = Field(
        True, description="encode each prompt once (off by itself when the text encoder trains or tags shuffle)"
    )
    cache_latents_to_disk: bool = Field(
        False, description="keep the latent cache in files under disk_cache_dir, reused by later runs and resumes "
                           "(memory then does not grow with the dataset; a cached image is not decoded)"
    )
    cache_text_encoder_outputs_to_disk: bool = Field(
        False, description="keep the text embedding cache in files under disk_cache_dir, reused by later runs"
    )
    disk_cache_dir: Path = Field(
        Path(".cache/encoded"), description="the disk caches: <this>/<VAE fingerprint>/, <this>/text-<encoders>/ "
                                            "and <this>/files/ (image hashes by file identity)"
    )
    channels_last: bool = Field(False, description="channels-last memory format for the UNet and VAE")

    def chosen_precision(self, device_type: str, formats: CpuFormats | None = None) -> Choice:
        """The mixed precision this run trains in on `device_type`, and why: `auto` on a CPU is bf16
        where it is native and `no` (fp32) where it would be emulated, `no` elsewhere (a GPU, XLA);
        an explicit bf16 on a CPU that emulates it is refused (UserError naming the cost and the fix)."""
        key = f"train.mixed_precision: {self.mixed_precision}"
        if device_type != "cpu":
            if self.mixed_precision == "auto":
                return Choice("no", f"auto: fp32 on {device_type}")
            return Choice(self.mixed_precision, key)
        if self.mixed_precision == "auto":
            choice = auto_bf16(formats)
            return Choice("bf16" if choice.precision == "bf16" else "no", choice.why)
        if self.mixed_precision == "bf16" and (problem := emulated_bf16_problem(
                "train.mixed_precision", "train.mixed_precision: auto or no (fp32)", formats)):
            raise UserError(f"params.yaml: {problem}")
        return Choice(self.mixed_precision, f"{key}, on {(formats or detect()).describe()}")

    def with_precision_chosen(self, device_type: str, formats: CpuFormats | None = None) -> tuple[Any, Choice]:
        """(this config with `mixed_precision` as chosen (never auto), the choice)."""
        choice = self.chosen_precision(device_type, formats)
        return self.model_copy(update={"mixed_precision": choice.precision}), choice

    def _precision_problem(self) -> str | None:
        if self.mixed_precision == "fp16":
            import torch

            if not torch.cuda.is_available():
                return ("mixed_precision fp16 needs a CUDA GPU (CPUs have no fp16 autocast for training); "
                        "use auto, bf16 or no")
        if self.full_bf16:
            return self._full_bf16_problem()
        return None

    def _full_bf16_problem(self) -> str | None:
        if self.mixed_precision != "bf16":
            return "full_bf16 needs mixed_precision: bf16 (or set full_bf16: null)"
        if method_spec(self.method).frozen_base:
            return (f"full_bf16 holds the weights that {' and '.join(names_training('weights'))} train; {self.method} "
                    "trains small tensors kept in float32: set full_bf16: null")
        if self.optimizer_choice != "adamw":
            key = "use_8bit_adam" if self.use_8bit_adam else f"optimizer: {self.optimizer_choice}"
            return (f"full_bf16 updates bf16 weights with its own AdamW (float32 moments, stochastic rounding); {key} "
                    "would update them in bf16 and lose the small steps: set full_bf16: false, or optimizer: adamw")
        clash = {"use_ema": self.use_ema, "cpu_backend: ipex": self.cpu_backend == "ipex"}
        if on := [k for k, v in clash.items() if v]:
            return (f"full_bf16 comes with its own optimizer and float32 moments; {', '.join(on)} cannot go with "
                    "it (a bf16 EMA that loses its updates, IPEX's own float32 master weights): "
                    "set full_bf16: false, or turn those off")
        return None

    def _cache_problem(self) -> str | None:
        if self.cache_latents_to_disk and not self.cache_latents:
            return "cache_latents_to_disk needs cache_latents: true"
        if self.cache_text_encoder_outputs_to_disk and not self.cache_text_encoder_outputs:
            return "cache_text_encoder_outputs_to_disk needs cache_text_encoder_outputs: true"
        return None

    def bf16_weights(self, device_type: str) -> bool:
        """Whether the trained weights are held in bf16 (`full_bf16`; null: where measured to win, which
        needs the fused update, so a C++ compiler for torch.compile)."""
        if self.full_bf16 is not None:
            return self.full_bf16
        return (device_type == "cpu" and self.mixed_precision == "bf16" and not method_spec(self.method).frozen_base
                and self.optimizer_choice == "adamw" and not (self.use_ema or self.cpu_backend == "ipex")
                and bool(cxx_compiler()))


def base_precision_problem(cfg: Any) -> str | None:
    """Why `train.base_model_precision` cannot go with this config (value, package, method, adapter,
    launcher), or None. The device is checked again once it is known (tasks/train/core.py)."""
    try:
        precision = BasePrecision.parse(cfg.base_model_precision)
    except ValueError as err:
        return str(err)
    if precision is None:
        return None
    key = f"base_model_precision: {cfg.base_model_precision}"
    spec = method_spec(cfg.method)
    if not spec.frozen_base:
        return (f"{key}: method {cfg.method} updates the base's own weights, which a quantized base cannot train "
                f"(8- and 4-bit weights have no gradient step); use method: {' or '.join(names_training('adapters'))}, "
                "or base_model_precision: none")
    if cfg.launcher == "xla":
        return f"{key}: XLA has none of the quantized kernels; use launcher local, accelerate or mpirun"
    return spec.base_precision_problem(cfg, precision)  # the method's own (LoRA's adapter types)


def text_precision_problem(cfg: Any) -> str | None:
    """Why `train.text_encoder_precision` cannot go with this config, or None: the encoders must stay
    frozen (textual inversion and train_text_encoder train through them)."""
    try:
        precision = BasePrecision.parse(cfg.text_encoder_precision, "text_encoder_precision")
    except ValueError as err:
        return str(err)
    if precision is None:
        return None
    key = f"text_encoder_precision: {cfg.text_encoder_precision}"
    spec = method_spec(cfg.method)
    if spec.through_text_encoder or cfg.train_text_encoder:
        trains = f"{cfg.method} trains an {spec.trains}" if spec.through_text_encoder else \
            "train_text_encoder: true trains"
        return (f"{key}: {trains} through the text encoder, which a quantized one cannot give gradients to; "
                "set text_encoder_precision: none")
    if cfg.cache_text_encoder_outputs_to_disk:
        return (f"{key}: the disk text cache is keyed by the encoders' weights, which quantized ones do not "
                "expose as bytes; set cache_text_encoder_outputs_to_disk: false (the cache stays in memory) "
                "or text_encoder_precision: none")
    if precision.name != "int8-torchao":
        return (f"{key}: the text encoders take torchao's int8 only (the one run here: FLUX.1's and SD3.5's "
                "CLIP and T5); use text_encoder_precision: int8")
    if cfg.launcher == "xla":
        return f"{key}: XLA has none of the quantized kernels; use launcher local, accelerate or mpirun"
    return precision.problem(key="text_encoder_precision")
