"""The `evaluate` section of params.yaml."""
from __future__ import annotations

import string
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from tasks.common.config import StageConfig
from tasks.common.quantize import BasePrecision

_FIELDS = {"identifier", "class_name"}


class GateConfig(StageConfig):
    """Promotion gate: every threshold that is not null must hold (>=) for `gate.passed`.

    `min_<metric>` bounds the fine-tuned model's score; `min_gain_<metric>` bounds fine-tuned
    minus base on the same prompts and seeds (negative = a tolerated loss).
    """

    min_clip_t: float | None = Field(None, ge=-1.0, le=1.0, description="lowest CLIP-T (prompt fidelity)")
    min_clip_i: float | None = Field(None, ge=-1.0, le=1.0, description="lowest CLIP-I (subject fidelity)")
    min_dino: float | None = Field(None, ge=-1.0, le=1.0, description="lowest DINO (subject fidelity)")
    min_gain_clip_t: float | None = Field(None, ge=-2.0, le=2.0, description="lowest CLIP-T gain over the base")
    min_gain_clip_i: float | None = Field(None, ge=-2.0, le=2.0, description="lowest CLIP-I gain over the base")
    min_gain_dino: float | None = Field(None, ge=-2.0, le=2.0, description="lowest DINO gain over the base")
    min_drift_clip_i: float | None = Field(
        None, ge=-1.0, le=1.0, description="class images of fine-tuned vs base (1: no drift)"
    )
    min_drift_dino: float | None = Field(
        None, ge=-1.0, le=1.0, description="as min_drift_clip_i, in DINO features (1: no drift)"
    )
    min_export_psnr: float | None = Field(
        None, ge=0.0, le=100.0,
        description="export fidelity: lowest per-image PSNR (dB) of OpenVINO vs PyTorch fine-tune",
    )
    min_edit_clip_t: float | None = Field(
        None, ge=-1.0, le=1.0, description="edit set: lowest CLIP-T of an edit to its instruction")
    min_edit_clip_i: float | None = Field(
        None, ge=-1.0, le=1.0, description="edit set: lowest CLIP-I of an edit to its target")
    min_edit_dino: float | None = Field(
        None, ge=-1.0, le=1.0, description="edit set: lowest DINO of an edit to its target")
    min_gain_edit_clip_t: float | None = Field(
        None, ge=-2.0, le=2.0, description="edit set: lowest CLIP-T gain over the base's edits")
    min_gain_edit_clip_i: float | None = Field(
        None, ge=-2.0, le=2.0, description="edit set: lowest CLIP-I gain over the base's edits")
    min_gain_edit_dino: float | None = Field(
        None, ge=-2.0, le=2.0, description="edit set: lowest DINO gain over the base's edits")
    min_i2v_clip_t: float | None = Field(
        None, ge=-1.0, le=1.0, description="image-to-video clips: lowest CLIP-T to their captions")
    min_i2v_clip_i: float | None = Field(
        None, ge=-1.0, le=1.0, description="image-to-video clips: lowest CLIP-I to the subject frames")
    min_i2v_dino: float | None = Field(
        None, ge=-1.0, le=1.0, description="image-to-video clips: lowest DINO to the subject frames")
    min_gain_i2v_clip_t: float | None = Field(
        None, ge=-2.0, le=2.0, description="image-to-video clips: lowest CLIP-T gain over the base's")
    min_gain_i2v_clip_i: float | None = Field(
        None, ge=-2.0, le=2.0, description="image-to-video clips: lowest CLIP-I gain over the base's")
    min_gain_i2v_dino: float | None = Field(
        None, ge=-2.0, le=2.0, description="image-to-video clips: lowest DINO gain over the base's")


class DriftConfig(StageConfig):
    """Language drift: does the fine-tuned model still draw the class like the base does?

    The class prompts go through both models from the same seeds; the paired cosine similarity
    of the two images (CLIP-I and DINO features) is 1.0 when fine-tuning left the class intact.
    """

    enabled: bool = Field(True, description="generate the class prompts with both models, compare")
    prompts: list[str] = Field(
        default_factory=lambda: ["a photo of a {class_name}"],
        description="templates with {class_name} (and {identifier}, unusual here)",
    )
    images_per_prompt: int = Field(2, ge=1, le=64, description="images per class prompt and model")

    @field_validator("prompts")
    @classmethod
    def _templates(cls, prompts: list[str]) -> list[str]:
        return check_templates(prompts)


class ExportFidelityConfig(StageConfig):
    """Export fidelity: the OpenVINO export against the PyTorch fine-tune it was made from.

    The first `max_prompts` prompts (null: all) go through the export (--export) from the same
    seeds and latents as the PyTorch images; the report's `export_fidelity` section has the
    per-image PSNR and the export's CLIP-T / CLIP-I / DINO beside the PyTorch ones (deltas). Kept
    apart from the gains, which compare base and fine-tune on one backend and precision.
    """

    enabled: bool = Field(True, description="compare the export (--export) with the fine-tune")
    max_prompts: int | None = Field(None, ge=1, description="first N prompts (null: all)")


class HeldoutConfig(StageConfig):
    """For `full` fine-tunes on a captioned dataset: generalisation to held-out captions.

    One image per held-out caption (CLI --heldout-data: an imagefolder with metadata.jsonl),
    scored by CLIP-T against its caption, and a Fréchet distance between the generated and the
    held-out real images in the CLIP image encoder's feature space (lower is closer).
    """

    enabled: bool = Field(False, description="score held-out captions (needs --heldout-data)")
    max_images: int = Field(64, ge=2, le=10000, description="first N held-out captions/images")

class EditsConfig(StageConfig):
    """Edit datasets: each (reference images, target, instruction) triple of the instance data.

    Acts only when the instance data's targets list references (metadata.jsonl
    `reference_file_names`, from ingest): the first `max_pairs` triples go through the fine-tune and
    the base, one call each (its references, its instruction, the target's size, the same seed and
    latents for both); each edit is scored against its target (DINO, CLIP-I) and instruction (CLIP-T).
    """

    enabled: bool = Field(True, description="score the edit set when the instance data has references")
    max_pairs: int = Field(4, ge=1, le=1000, description="first N (references, target, instruction) triples")


class ImageToVideoConfig(StageConfig):
    """A video model trained as image-to-video (train.first_frame_conditioning_p > 0): clips started from a frame.

    Each of the first `max_clips` subject clips (the instance data's clips.jsonl) is continued from its
    first frame with its caption, by the fine-tune and the base from the same seeds, through the family's
    first-frame pipeline; scored as the text-to-video clips are, reported as i2v_* (gated only by the
    gate's min_i2v_* / min_gain_i2v_* thresholds, all null by default).
    """

    enabled: bool | None = Field(
        None, description="make and score the image-to-video clips; null: when train.first_frame_conditioning_p "
                          "> 0 (the model trained that way)")
    max_clips: int = Field(2, ge=1, le=1000, description="first N subject clips (clips.jsonl order)")


class EvaluateConfig(StageConfig):
    """`evaluate` section: prompts, sampling, encoders and the gate."""

    identifier: str = Field("sks", min_length=1, description="the rare token naming the subject")
    class_name: str = Field("toy", min_length=1, description="the subject's class, e.g. toy or dog")
    prompt_set: Literal["object", "live", "custom"] = Field(
        "custom", description="the DreamBooth paper's 25 object / live-subject prompts, or `prompts`"
    )
    prompts: list[str] = Field(
        default_factory=list, description="custom templates: {identifier}, {class_name}"
    )
    max_prompts: int | None = Field(None, ge=1, description="first N of the set (demo: short)")
    images_per_prompt: int = Field(2, ge=1, le=64, description="images per prompt and model")
    num_inference_steps: int = Field(10, ge=1, le=500, description="denoising steps per image")
    resolution: int | None = Field(
        None, ge=16, le=4096, multiple_of=16,
        description="px (square) of every image when no export fixes the size (export.enabled false, or "
        "export_fidelity off); null: the denoiser's native size (1024 for FLUX.1-dev)")
    guidance_scale: float = Field(
        7.5, gt=1.0, description="> 1: a static OpenVINO export's UNet batch has the CFG branch"
    )
    seed: int = Field(0, ge=0, description="image j of each prompt starts from seed + j's latents")
    compare_base: bool = Field(True, description="also generate with the base model: gains")
    clip_model: str = Field(
        "builtin:tiny-clip", min_length=1,
        description="CLIP for CLIP-T/CLIP-I: builtin:tiny-clip (random weights) | hub id | folder",
    )
    clip_revision: str | None = Field(None, description="pinned commit for a hub clip_model")
    dino_model: str = Field(
        "builtin:tiny-dino", min_length=1,
        description="DINO ViT for DINO: builtin:tiny-dino (random weights) | hub id | folder",
    )
    dino_revision: str | None = Field(None, description="pinned commit for a hub dino_model")
    encoder_seed: int = Field(0, ge=0, description="weights of the built-in encoders")
    gate: GateConfig = Field(default_factory=GateConfig)
    drift: DriftConfig = Field(default_factory=DriftConfig)
    heldout: HeldoutConfig = Field(default_factory=HeldoutConfig)
    export_fidelity: ExportFidelityConfig = Field(default_factory=ExportFidelityConfig)
    edits: EditsConfig = Field(default_factory=EditsConfig)
    image_to_video: ImageToVideoConfig = Field(default_factory=ImageToVideoConfig)
    base_cache_dir: str | None = Field(
        None,
        description="the base's images kept here by the base's fingerprint, the prompts and the generation "
        "protocol, so the next fine-tune of the same base reuses them without loading the base; null: "
        "generate them every time (params.yaml: .cache/evaluate-base)",
    )
    base_model_precision: str | None = Field(
        None, description="the fine-tune and the base generated with the denoiser's Linear layers quantized as they "
                          "load (the train stage's frozen base; LoRA/DoRA unfused on top), the rest in the "
                          "denoiser's stored dtype: none (fp32) | int8 | fp8 | nf4, or with a library (int8-quanto, "
                          "int8-bnb, fp8-quanto); null: train.base_model_precision's value",
    )

    @model_validator(mode="after")
    def _precision(self) -> EvaluateConfig:
        if self.base_model_precision is not None:
            BasePrecision.parse(self.base_model_precision, key="base_model_precision")  # ValueError: the choices
        return self

    @model_validator(mode="before")
    @classmethod
    def _no_backend(cls, data: Any) -> Any:
        if isinstance(data, dict) and "backend" in data:
            raise ValueError(
                "evaluate.backend was removed: base and fine-tune are both generated in PyTorch "
                "fp32 (like with like, for the gains) and the OpenVINO export is compared with the "
                "PyTorch fine-tune in its own section (evaluate.export_fidelity); delete the key"
            )
        return data

    @field_validator("prompts")
    @classmethod
    def _templates(cls, prompts: list[str]) -> list[str]:
        return check_templates(prompts)

    @model_validator(mode="after")
    def _custom_needs_prompts(self) -> EvaluateConfig:
        if self.prompt_set == "custom" and not self.prompts:
            raise ValueError("prompt_set custom needs prompts (or use object / live)")
        return self

    @model_validator(mode="after")
    def _gains_need_base(self) -> EvaluateConfig:
        keys = ("min_gain_clip_t", "min_gain_clip_i", "min_gain_dino", "min_drift_clip_i",
                "min_drift_dino", *EDIT_GAIN_THRESHOLDS, *I2V_GAIN_THRESHOLDS)
        gains = [k for k in keys if getattr(self.gate, k) is not None]
        if gains and not self.compare_base:
            raise ValueError(
                f"gate.{gains[0]} needs compare_base: true (it is measured against the base)"
            )
        drift = [k for k in keys[3:5] if getattr(self.gate, k) is not None]
        if drift and not self.drift.enabled:
            raise ValueError(f"gate.{drift[0]} needs drift.enabled: true")
        if self.gate.min_export_psnr is not None and not self.export_fidelity.enabled:
            raise ValueError("gate.min_export_psnr needs export_fidelity.enabled: true")
        edit = self.edit_thresholds()
        if edit and not self.edits.enabled:
            raise ValueError(f"gate.{edit[0]} needs edits.enabled: true (it scores the edit set)")
        i2v = self.i2v_thresholds()
        if i2v and self.image_to_video.enabled is False:
            raise ValueError(f"gate.{i2v[0]} needs image_to_video.enabled: true or null (it scores the "
                             "image-to-video clips)")
        return self

    def i2v_thresholds(self) -> list[str]:
        """The gate's image-to-video thresholds that are set (they need the image-to-video clips)."""
        return [k for k in (*I2V_THRESHOLDS, *I2V_GAIN_THRESHOLDS) if getattr(self.gate, k) is not None]

    def edit_thresholds(self) -> list[str]:
        """The gate's edit-set thresholds that are set (they need an edit set to measure)."""
        return [k for k in (*EDIT_THRESHOLDS, *EDIT_GAIN_THRESHOLDS) if getattr(self.gate, k) is not None]


EDIT_THRESHOLDS = ("min_edit_clip_t", "min_edit_clip_i", "min_edit_dino")
EDIT_GAIN_THRESHOLDS = ("min_gain_edit_clip_t", "min_gain_edit_clip_i", "min_gain_edit_dino")
I2V_THRESHOLDS = ("min_i2v_clip_t", "min_i2v_clip_i", "min_i2v_dino")
I2V_GAIN_THRESHOLDS = ("min_gain_i2v_clip_t", "min_gain_i2v_clip_i", "min_gain_i2v_dino")


def check_templates(prompts: list[str]) -> list[str]:
    """Every template is non-empty and uses only {identifier} and {class_name}."""
    for prompt in prompts:
        if not prompt.strip():
            raise ValueError("prompts must not be empty")
        names = {f for _, f, _, _ in string.Formatter().parse(prompt) if f is not None}
        unknown = names - _FIELDS
        if unknown:
            raise ValueError(
                f"{prompt!r} uses {sorted(unknown)}; only {{identifier}} and {{class_name}} "
                "are filled in"
            )
    return prompts


def quantized(cfg: EvaluateConfig) -> BasePrecision | None:
    """The quantized denoiser `cfg` asks for (its base_model_precision, resolved: following_train)."""
    return BasePrecision.parse(cfg.base_model_precision or "none", key="evaluate.base_model_precision")


def following_train_i2v(cfg: EvaluateConfig, params: dict[str, Any]) -> EvaluateConfig:
    """`cfg` with image_to_video.enabled null replaced by whether params.yaml's train stage trained the model
    as image-to-video (train.first_frame_conditioning_p > 0; 0, its default, where the train section leaves it
    out); a UserError names both keys for a value that is not a number."""
    from tasks.common.errors import UserError

    if cfg.image_to_video.enabled is not None:
        return cfg
    value = (params.get("train") or {}).get("first_frame_conditioning_p", 0.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UserError(f"evaluate.image_to_video.enabled is null, so it follows train.first_frame_conditioning_p, "
                        f"which must be a number from 0 to 1, not {value!r}")
    section = cfg.image_to_video.model_copy(update={"enabled": value > 0})
    return cfg.model_copy(update={"image_to_video": section})
