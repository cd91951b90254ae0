"""The `export` section of params.yaml."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tasks.common.config import StageConfig


class ParityConfig(StageConfig):
    """The same prompt, seed and initial latents through PyTorch and OpenVINO, compared."""

    enabled: bool = Field(True, description="false: skip the comparison (and its gate)")
    prompt: str = Field("a photo of sks toy", min_length=1, description="prompt of both images")
    num_inference_steps: int = Field(5, ge=1, le=200, description="denoising steps of both")
    guidance_scale: float = Field(7.5, gt=1.0, description="> 1: the static UNet batch has CFG")
    seed: int = Field(0, ge=0, description="seed of the shared initial latents")
    min_psnr_db: float | None = Field(
        30.0, description="fail when image PSNR (OpenVINO vs PyTorch) is below; null: record only"
    )
    component_max_rel: float | None = Field(
        0.1, ge=0.0,
        description="components one_at_a_time: fail when a converted component's output differs from "
        "its PyTorch source's by more than this share of the source output's largest magnitude; null: "
        "record only",
    )
    pipeline_image: bool = Field(
        True,
        description="components one_at_a_time: also compare a whole-pipeline image with PyTorch (fp32) "
        "at the export's static shape; false where the fp32 pipeline does not fit in memory",
    )


class CompressionConfig(StageConfig):
    """NNCF weight compression / hybrid quantization of the written model (see compress.py)."""

    mode: Literal["none", "int8", "int4", "hybrid", "full_int8"] = Field(
        "none", description="none: the fp32 export is written; otherwise the compressed one"
    )
    sym: bool = Field(False, description="symmetric quantization (asymmetric is more accurate)")
    group_size: int = Field(64, ge=-1, description="int4: weights per scale group (-1: per row)")
    ratio: float = Field(1.0, gt=0.0, le=1.0, description="int4: share of layers in 4 bit")
    calibration_prompts: list[str] = Field(
        default_factory=lambda: ["a photo of a toy", "a photo of sks toy on the beach"],
        description="hybrid, full_int8: prompts the pipeline runs to calibrate the UNet's "
        "activations",
    )
    num_samples: int | None = Field(
        None, ge=1,
        description="hybrid, full_int8: UNet calls collected for calibration (null: 200)",
    )
    min_psnr_db: float | None = Field(
        None, description="fail when compressed vs fp32 image PSNR is below; null: record only"
    )

    @model_validator(mode="after")
    def _prompts(self) -> CompressionConfig:
        if self.mode in ("hybrid", "full_int8") and not self.calibration_prompts:
            raise ValueError(f"{self.mode} quantization needs calibration_prompts")
        return self


class ExportConfig(StageConfig):
    """`export` section: the static shape of the OpenVINO pipeline, and the parity check."""

    enabled: bool = Field(
        True,
        description="false: no OpenVINO export, only a note in its folder (export_skipped.json), for a model "
        "too big to convert on this machine; evaluate then scores the PyTorch fine-tune alone and the "
        "registered version serves it with diffusers",
    )
    batch_size: int = Field(1, ge=1, le=64, description="prompts per pipeline call")
    height: int = Field(
        64, ge=8, le=4096, multiple_of=8, description="image height in pixels, fixed in the export"
    )
    width: int = Field(
        64, ge=8, le=4096, multiple_of=8, description="image width in pixels, fixed in the export"
    )
    num_images_per_prompt: int = Field(
        1, ge=1, le=64, description="images per prompt per call, fixed in the export"
    )
    parity: ParityConfig = Field(default_factory=ParityConfig)
    compression: CompressionConfig = Field(default_factory=CompressionConfig)
    inference_precision: Literal["auto", "bf16", "f16", "f32"] = Field(
        "auto",
        description="precision OpenVINO computes in when the export is timed, evaluated and "
        "served (recorded in the folder); parity is always checked in f32. auto: OpenVINO's "
        "choice for the CPU (bf16 where it has native bf16: AVX-512 BF16 or AMX; else f32)",
    )
    single_file: Literal["none", "fp16", "bf16", "fp32"] = Field(
        "none",
        description="also write single_file/model.safetensors in the original SD layout "
        "(AUTOMATIC1111, ComfyUI, from_single_file), in this dtype; SD 1.x, SD 2.x and SDXL",
    )
    latency_dynamic: bool = Field(
        True, description="also time the fp32 export with dynamic shapes (one more compile)"
    )
    placeholder_token: str | None = Field(
        None, description="token of an SDXL learned_embeds.safetensors (SD files carry theirs)"
    )
    components: Literal["whole", "one_at_a_time"] = Field(
        "whole",
        description="whole: optimum-intel converts the whole pipeline in fp32; one_at_a_time: each "
        "model (text encoders, denoiser, VAE) is loaded in its stored dtype, converted, checked "
        "against PyTorch, compressed and written before the next loads (models too big for memory "
        "in fp32)",
    )
    adapters: Literal["fused", "runtime"] = Field(
        "fused",
        description="fused: LoRA outputs are fused into a full export of their own; runtime: the "
        "base is exported once (base/, shared by every fine-tune of it) and the LoRA is kept "
        "beside it for OpenVINO GenAI to apply per call (SD 1.x/2.x, SDXL, SD3 transformer "
        "LoRAs; plain LoRA; f32 inference over an f32 or int8-weight base)",
    )
    base_cache_dir: str | None = Field(
        ".cache/openvino-base",
        description="runtime: base exports kept here by the base's fingerprint, so the next "
        "fine-tune of the same base reuses it; null: export the base every time",
    )

    @model_validator(mode="after")
    def _batch_not_huge(self) -> ExportConfig:
        if self.batch_size * self.num_images_per_prompt > 64:
            raise ValueError("batch_size x num_images_per_prompt must be at most 64")
        return self

    @model_validator(mode="after")
    def _one_at_a_time(self) -> ExportConfig:
        if self.components != "one_at_a_time":
            return self
        why = {
            "compression.mode": (self.compression.mode in ("hybrid", "full_int8"), "calibrating "
                                 "activations runs the whole pipeline: set none, int8 or int4, or "
                                 "export.components: whole"),
            "adapters": (self.adapters != "fused", "run-time adapters keep their own base export: set "
                         "fused, or export.components: whole"),
            "single_file": (self.single_file != "none", "the single file is written from the whole "
                            "PyTorch pipeline: set none, or export.components: whole"),
        }
        for key, (bad, fix) in why.items():
            if bad:
                raise ValueError(f"export.components: one_at_a_time does not take this export.{key}: {fix}")
        return self

    @model_validator(mode="after")
    def _runtime_adapters(self) -> ExportConfig:
        if self.adapters != "runtime":
            return self
        why = {
            "batch_size": (self.batch_size != 1, "GenAI takes one prompt per call: set 1 (and "
                           "num_images_per_prompt for more images)"),
            "compression.mode": (self.compression.mode not in ("none", "int8"), "the runtime base "
                                 "takes weight-only int8 (GenAI adds the LoRA branch beside each "
                                 "compressed weight); 4-bit and activation quantization are not "
                                 "checked with run-time adapters: set none or int8, or "
                                 "export.adapters: fused"),
            "single_file": (self.single_file != "none", "a single file holds a fused model: set "
                            "none, or export.adapters: fused"),
            "inference_precision": (self.inference_precision not in ("auto", "f32"), "GenAI "
                                    "2026.4's run-time LoRA gave wrong images at bf16 on this CPU "
                                    "(21.6 dB, then 6.0 dB for the same adapter): set f32 or auto"),
        }
        for key, (bad, fix) in why.items():
            if bad:
                raise ValueError(f"export.adapters: runtime does not take this export.{key}: {fix}")
        return self
