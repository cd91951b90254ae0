"""The `class_images` section of params.yaml."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tasks.common.concepts import ConceptName
from tasks.common.config import StageConfig
from tasks.common.launch import LAUNCHERS, LaunchConfig, launch_problem
from tasks.common.quantize import BasePrecision


class ClassConcept(StageConfig):
    """One entry of `class_images.concepts`: the class images of one concept, in <out>/<name>/."""

    name: ConceptName = Field(description="the concept (as in train.concepts); its folder")
    prompt: str = Field(min_length=1, description="its class prompt (train.concepts' class_prompt)")
    num_images: int = Field(8, ge=0, le=100_000, description="class images of this concept")
    negative_prompt: str | None = Field(None, description="null: class_images.negative_prompt")


class ClassImagesConfig(StageConfig):
    """`class_images` section: what to generate for DreamBooth's prior-preservation loss."""

    prompt: str = Field("a photo of a toy", min_length=1, description="class prompt, without the identifier")
    num_images: int = Field(
        8, ge=0, le=100_000, description="images to have in the folder; the DreamBooth paper uses ~200"
    )
    resolution: int = Field(64, ge=8, le=4096, multiple_of=8, description="square side in pixels")
    batch_size: int = Field(4, ge=1, le=1024, description="images per pipeline call (does not change the images)")
    num_inference_steps: int = Field(10, ge=1, le=1000, description="denoising steps per image")
    guidance_scale: float = Field(7.5, ge=0.0, le=50.0, description="classifier-free guidance scale")
    negative_prompt: str | None = Field(None, description="optional negative prompt")
    seed: int = Field(0, ge=0, description="image i is drawn from a generator seeded with seed + i")
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", description="the generating pipeline's weights and compute (diffusers' --prior_generation_precision); "
                            "auto: fp16 on CUDA; on a CPU bf16 where the base's denoiser is stored in bf16 or fp16 "
                            "and the CPU computes bf16 natively (AVX512-BF16, AMX-BF16: bf16 releases such as FLUX "
                            "and SD3.5 then take half the memory of fp32), else fp32 (SD 1.x, the built-in models, "
                            "and any base on an AVX2-only CPU, where bf16 is emulated ~500x slower); bf16 on such "
                            "a CPU is refused",
    )
    vae_decode: Literal["auto", "full", "sliced", "tiled"] = Field(
        "auto", description="how the VAE decodes: full | sliced (one image of a batch at a time: the same images) | "
                            "tiled (in overlapping tiles: a few GB less at large sizes, slightly different pixels, "
                            "so part of the images' key); auto: sliced, tiled above 1024 px",
    )
    base_model_precision: str | None = Field(
        None, description="the denoiser's Linear layers quantized as they load, as the train stage holds it: none | "
                          "int8 | fp8 | nf4, or with a library (int8-quanto, int8-bnb, fp8-quanto); null: "
                          "train.base_model_precision's value (a 12B denoiser in int8 takes half its bf16 memory)",
    )
    launcher: Literal[LAUNCHERS] = Field(  # type: ignore[valid-type]
        "local", description="local | accelerate | mpirun | xla: each rank generates its share of the images"
    )
    launch: LaunchConfig = Field(default_factory=LaunchConfig, description="topology and environment of a launch")
    concepts: list[ClassConcept] = Field(
        [], description="class images per concept, each in <out>/<name>/ with its prompt and count (seeds: seed + "
                        "100000 x its position); empty: one set of `prompt` in <out>",
    )

    @model_validator(mode="after")
    def _check(self) -> ClassImagesConfig:
        if self.base_model_precision is not None:
            BasePrecision.parse(self.base_model_precision, key="base_model_precision")  # ValueError: the choices
        if self.launcher == "xla":
            raise ValueError("launcher xla is for training: generate class images with local, mpirun or accelerate")
        if problem := launch_problem(self.launcher, self.launch):
            raise ValueError(problem)
        if self.negative_prompt is not None and self.guidance_scale <= 1:
            raise ValueError("negative_prompt is set, but guidance_scale <= 1 turns classifier-free guidance off, "
                             "which is what reads it: set guidance_scale above 1, or remove negative_prompt")
        names = [c.name for c in self.concepts]
        if twice := sorted({n for n in names if names.count(n) > 1}):
            raise ValueError(f"concepts: {', '.join(map(repr, twice))} listed twice; name each concept once")
        return self

