"""The `train` section of params.yaml: what to train; `launcher`/`launch` say where (tasks.common.launch).

Option names are those of diffusers' example scripts (train_dreambooth.py, textual_inversion.py,
train_text_to_image.py and their LoRA variants) where they exist, kohya sd-scripts' otherwise
(`cache_latents`, `keep_tokens`), and the training notes' for tag shuffling (`shuffle_tag_p`).
Every check that can be made without loading a model is made here, at config load, so a bad
setting fails before minutes of loading.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from tasks.common import families
from tasks.common.adapters import ADAPTER_TYPES
from tasks.common.config import StageConfig
from tasks.common.errors import UserError
from tasks.common.launch import LAUNCHERS, LaunchConfig, launch_problem
from tasks.common.safe_remove import own_folder
from tasks.train.concepts import ConceptConfig, concepts_problem
from tasks.train.config_sections import (
    CheckpointScoringConfig,
    XlaConfig,
    base_precision_problem,
    text_precision_problem,
)
from tasks.train.methods.spec import MethodSpec, method_spec, names_training
from tasks.train.methods.spec import names as method_names
from tasks.train.no_ops import config_no_ops, family_no_ops

LR_SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts", "polynomial")

#: Keys that do not change what a step computes: a run resumed with other values of these is the
#: same run (e.g. more steps, other checkpoint or validation settings). Every other key is part of
#: the run key that names the checkpoint folder, so `resume: latest` never mixes two runs.
NOT_IN_RUN_KEY = frozenset({
    "max_train_steps", "checkpointing_steps", "checkpoints_total_limit", "keep_checkpoints_every_steps",
    "checkpoints_dir", "resume",
    "validation_prompts", "num_validation_images", "validation_steps", "validation_inference_steps",
    "log_every_steps", "system_metrics_interval", "dataloader_num_workers", "cache_latents",
    "cache_latents_to_disk", "cache_text_encoder_outputs_to_disk", "disk_cache_dir",
    "cache_text_encoder_outputs", "fuse_lora", "xla",
    # How the processes were started does not change a step; how many there are does (the global
    # batch, the data each rank reads, one RNG file per rank in a checkpoint), so the run key
    # holds the number of processes actually training instead (checkpoints.run_key): a resume
    # must use the same num_processes, whatever the launcher, hosts or threads.
    "launcher", "launch",
    # Which checkpoint becomes the output, and how checkpoints are scored, do not change a step.
    "select_checkpoint", "checkpoint_scoring",
})

def cxx_compiler() -> str | None:
    """The C++ compiler torch.compile's CPU code needs (inductor's: $CXX, else g++), or None."""
    return shutil.which(os.environ.get("CXX") or "g++")

class TrainConfig(StageConfig):
    """`train` section. Grouped as in diffusers' scripts; `method` picks what is trained and saved."""

    method: str = Field("dreambooth", description=" | ".join(method_names()) + " (tasks/train/methods/specs/)")
    # --- prompts and captions ---------------------------------------------------------------
    instance_prompt: str = Field("a photo of sks toy", min_length=1, description="prompt with the unique identifier")
    caption_column: str | None = Field(
        None, min_length=1,
        description="metadata.jsonl column with per-image captions; null: instance_prompt for every image "
                    "(method full: 'text')",
    )
    shuffle_tag_p: float = Field(0.0, ge=0.0, le=1.0, description="chance to shuffle an image's tags")
    keep_tokens: int = Field(0, ge=0, description="the first N tags stay in place when shuffling")
    proportion_empty_prompts: float = Field(0.0, ge=0.0, lt=1.0, description="caption dropout: chance of ''")
    # --- prior preservation (DreamBooth; also usable as regularisation by lora and full) -----
    class_prompt: str = Field("a photo of a toy", min_length=1, description="prompt of the class images")
    with_prior_preservation: bool = Field(True, description="add the prior-preservation loss over class images")
    prior_loss_weight: float = Field(1.0, ge=0.0, description="weight of the prior-preservation loss")
    train_text_encoder: bool = Field(False, description="also train the text encoder(s) (LoRA: add adapters)")
    # --- textual inversion -------------------------------------------------------------------
    placeholder_token: str | None = Field(None, min_length=1, description="new token, e.g. <sks-toy>")
    initializer_token: str | None = Field(None, min_length=1, description="one existing token to start from")
    num_vectors: int = Field(1, ge=1, le=64, description="embedding vectors learned for the placeholder")
    learnable_property: Literal["object", "style"] = Field("object", description="prompt templates to train with")
    # --- LoRA ----------------------------------------------------------------------------------
    rank: int = Field(4, ge=1, le=1024, description="LoRA rank")
    lora_alpha: float | None = Field(None, gt=0.0, description="LoRA alpha; null: equal to rank")
    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout probability of the LoRA layers")
    fuse_lora: bool = Field(True, description="also write the base pipeline with the LoRA fused in (for export)")
    lora_type: Literal[ADAPTER_TYPES] = Field(  # type: ignore[valid-type]
        "lora", description="lora | dora (weight-decomposed) | lokr (Kronecker) | loha (Hadamard), peft's layers")
    decompose_factor: int = Field(-1, ge=-1, description="LoKr: the Kronecker factor (peft's name); -1: automatic")
    # --- a quantized frozen base (QLoRA) ----------------------------------------------------------
    base_model_precision: str = Field(
        "none", description="none | int8 | fp8 | nf4, or with a library: int8-quanto, int8-bnb, fp8-quanto "
                            "(the denoiser's Linear layers quantized as they load; lora and textual_inversion)")
    text_encoder_precision: str = Field(
        "none", description="the frozen text encoders quantized as they load, while they build the text cache "
                            "(CLIP, T5-XXL): none | int8 (torchao)")
    # --- data ------------------------------------------------------------------------------------
    resolution: int = Field(64, ge=8, le=4096, multiple_of=8, description="training images are resized/cropped to this")
    center_crop: bool = Field(True, description="centre crop (false: random crop)")
    random_flip: bool = Field(False, description="flip images horizontally at random")
    # --- aspect-ratio buckets (kohya sd-scripts' names; a fixed list as diffusers' aspect_ratio_buckets) ----
    enable_bucket: bool = Field(False, description="train each image whole in the bucket nearest its aspect ratio")
    min_bucket_reso: int | None = Field(None, ge=8, description="shortest bucket side; null: resolution / 2")
    max_bucket_reso: int | None = Field(None, ge=8, description="longest bucket side; null: resolution x 2")
    bucket_reso_steps: int | None = Field(
        None, ge=8, multiple_of=8, description="bucket sides are multiples of this; null: 64 (8 below resolution 256)"
    )
    aspect_ratio_buckets: str | list[tuple[int, int]] | None = Field(
        None, description="a fixed bucket list, 'h,w;h,w' or [[h, w], ...] (diffusers); replaces the kohya rule"
    )
    train_batch_size: int = Field(2, ge=1, le=4096, description="instance images per device per step")
    dataloader_num_workers: int = Field(0, ge=0, le=64, description="data loader worker processes (0: in the main one)")
    # --- optimisation ----------------------------------------------------------------------------
    max_train_steps: int = Field(20, ge=1, description="optimizer steps")
    gradient_accumulation_steps: int = Field(1, ge=1, le=1024, description="batches per optimizer step")
    gradient_checkpointing: bool = Field(False, description="trade compute for memory in the UNet")
    learning_rate: float = Field(1e-4, gt=0.0, le=1.0, description="peak learning rate (before scale_lr)")
    scale_lr: bool = Field(False, description="multiply the LR by batch size x accumulation x processes")
    lr_scheduler: Literal[LR_SCHEDULERS] = Field("constant", description="learning-rate schedule")  # type: ignore[valid-type]
    lr_warmup_steps: int = Field(0, ge=0, description="optimizer steps of linear warm-up from 0")
    lr_num_cycles: int = Field(1, ge=1, description="restarts of cosine_with_restarts")
    lr_power: float = Field(1.0, gt=0.0, description="power of the polynomial schedule")
    use_8bit_adam: bool = Field(False, description="bitsandbytes AdamW8bit: less memory, much slower on CPU")
    adam_beta1: float = Field(0.9, ge=0.0, lt=1.0, description="AdamW beta1")
    adam_beta2: float = Field(0.999, ge=0.0, lt=1.0, description="AdamW beta2")
    adam_weight_decay: float = Field(1e-2, ge=0.0, description="AdamW weight decay")
    adam_epsilon: float = Field(1e-8, gt=0.0, description="AdamW epsilon")
    max_grad_norm: float = Field(1.0, gt=0.0, description="gradient clipping (total L2 norm)")
    mixed_precision: Literal["no", "bf16", "fp16"] = Field(
        "no", description="no | bf16 (autocast, also on CPU) | fp16 (CUDA only)"
    )
    full_bf16: bool | None = Field(
        None, description="hold the weights dreambooth and full train in bf16, updated by AdamW in float32 with "
                          "stochastic rounding (kohya's --full_bf16): no float32 weights or gradients; null: "
                          "on for those methods on a CPU with mixed_precision bf16 (tasks/train/README.md)")
    allow_tf32: bool = Field(False, description="TF32 matmuls on Ampere+ GPUs")
    prediction_type: Literal["epsilon", "v_prediction"] | None = Field(
        None, description="training target; null: the base model's scheduler setting"
    )
    snr_gamma: float | None = Field(None, gt=0.0, description="Min-SNR loss weighting (5.0 recommended); null: off")
    noise_offset: float = Field(0.0, ge=0.0, le=1.0, description="offset noise scale (0.05-0.1 typical)")
    # --- flow matching (SD3/3.5, FLUX.1; the names of diffusers' train_dreambooth*_sd3/flux.py) --------
    weighting_scheme: Literal["none", "sigma_sqrt", "logit_normal", "mode", "cosmap"] | None = Field(
        None, description="timestep density and loss weighting; null: the family's (SD3 logit_normal, FLUX none)"
    )
    logit_mean: float = Field(0.0, description="mean of the logit_normal weighting scheme")
    logit_std: float = Field(1.0, gt=0.0, description="std of the logit_normal weighting scheme")
    mode_scale: float = Field(1.29, description="scale of the mode weighting scheme")
    guidance_scale: float = Field(3.5, ge=0.0, description="FLUX guidance-distilled bases: the guidance input")
    max_sequence_length: int | None = Field(
        None, ge=1, le=512, description="T5 tokens per prompt; null: the family's (SD3 77, FLUX 512), at most "
                                        "the tokenizer's"
    )
    # --- EMA (seed 001; on the CPU as in seed 003) ----------------------------------------------
    use_ema: bool = Field(False, description="keep an exponential moving average of the trained weights; save it")
    ema_decay: float = Field(0.9999, gt=0.0, lt=1.0, description="EMA decay per update (use_ema)")
    offload_ema: bool = Field(False, description="keep the EMA weights in CPU memory (GPU runs)")
    ema_update_every: int = Field(1, ge=1, description="update the EMA every N optimizer steps")
    # --- speed ----------------------------------------------------------------------------------
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
    # --- back ends (tasks/train/README.md, "CPU and TPU back ends") ------------------------------
    cpu_backend: Literal["auto", "ipex", "native"] = Field(
        "auto", description="CPU runs: ipex (Intel Extension for PyTorch's ipex.optimize) | native (torch autocast) "
                            "| auto (ipex when it imports and matches torch, else native)"
    )
    torch_compile: bool = Field(False, description="torch.compile the UNet (CPU and GPU runs)")
    xla: XlaConfig = Field(default_factory=XlaConfig, description="PyTorch/XLA options (used when torch_xla runs)")
    # --- never lose progress ----------------------------------------------------------------------
    checkpoints_dir: Path = Field(
        Path(".cache/train"), description="checkpoints go to <this>/<run key>/checkpoint-<step> (outside DVC outs)"
    )
    checkpointing_steps: int = Field(500, ge=1, description="save the full training state every N steps")
    checkpoints_total_limit: int | None = Field(2, ge=1, description="keep the newest N checkpoints; null: all")
    keep_checkpoints_every_steps: int | None = Field(
        None, ge=1, description="checkpoints at multiples of N steps are never pruned (the notes' periodic ones)"
    )
    resume: str = Field("latest", min_length=1, description="latest | none | <checkpoint folder>")
    select_checkpoint: Literal["last", "best"] = Field(
        "last", description="what goes to --out: the last step's weights, or the best scored healthy checkpoint"
    )
    checkpoint_scoring: CheckpointScoringConfig = Field(
        default_factory=CheckpointScoringConfig, description="scoring: tasks/train/README.md, 'Best checkpoint'"
    )
    # --- reporting ----------------------------------------------------------------------------------
    validation_prompts: list[str] | None = Field(None, description="null: the method's training prompt")
    num_validation_images: int = Field(4, ge=0, le=64, description="images per validation prompt (0: none)")
    validation_steps: int = Field(0, ge=0, description="validation images every N steps (0: only at the end)")
    validation_inference_steps: int = Field(10, ge=1, le=1000, description="denoising steps per validation image")
    log_every_steps: int = Field(1, ge=1, description="MLflow metrics every N steps (the CSV has every step)")
    system_metrics_interval: float = Field(5, ge=0, description="MLflow system metrics every N seconds (0: off)")
    seed: int = Field(0, ge=0, description="same seed and params give the same weights")
    # --- where and on how many processes (tasks/common/launch.py; README "Launchers") ---------------
    launcher: Literal[LAUNCHERS] = Field(  # type: ignore[valid-type]
        "local", description="local | accelerate | mpirun | xla: python -m tasks.train re-executes itself under it"
    )
    launch: LaunchConfig = Field(default_factory=LaunchConfig, description="topology and environment of a launch")
    # --- several concepts in one run (kohya's subsets, OneTrainer's concepts) -------------------------
    concepts: list[ConceptConfig] = Field(
        [], description="datasets trained together, each with its prompts, class images, repeats and loss "
                        "weight; empty: one dataset (instance_prompt / captions, class_prompt, the rows' repeats)",
    )
    # --- masked training (tasks/train/README.md "Masked training"; masks from the ingest stage) -------
    masked_loss: bool = Field(
        False, description="weight the loss by each image's subject mask (kohya's name): the background is not "
        "learned; needs masks from the ingest stage (mask_dir, -masklabel.png, alpha_mask)",
    )
    masked_loss_unmasked_weight: float = Field(
        0.0, ge=0.0, le=1.0, description="loss weight of the pixels outside the mask (OneTrainer's unmasked_weight)"
    )
    unmasked_probability: float = Field(
        0.0, ge=0.0, le=1.0, description="chance that an example trains unmasked (OneTrainer's name; "
        "SimpleTuner's masked_loss_probability is 1 minus this), drawn per example and epoch",
    )
    normalize_masked_area_loss: bool = Field(
        False, description="divide each example's loss by its mask's mean weight, so a small subject "
        "weighs as much as a large one (OneTrainer's name)",
    )

    @field_validator("method")
    @classmethod
    def _known_method(cls, v: str) -> str:
        method_spec(v)  # a ValueError naming the known methods
        return v

    @field_validator("checkpoints_dir", "disk_cache_dir")
    @classmethod
    def _own_folders(cls, path: Path, info: Any) -> Path:
        """Folders the stage writes and prunes under: never the repository, an ancestor, / or home."""
        return own_folder(path, {"checkpoints_dir": ".cache/train"}.get(info.field_name, ".cache/encoded"))

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        problems = [p for p in (self._precision_problem(), self._method_problem(), self._option_problem(),
                                concepts_problem(self), base_precision_problem(self),
                                text_precision_problem(self)) if p]
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def _precision_problem(self) -> str | None:
        if self.mixed_precision == "fp16":
            import torch

            if not torch.cuda.is_available():
                return ("mixed_precision fp16 needs a CUDA GPU (CPUs have no fp16 autocast for training); "
                        "use bf16 or no")
        if self.use_8bit_adam and importlib.util.find_spec("bitsandbytes") is None:
            return "use_8bit_adam needs the bitsandbytes package (pip install bitsandbytes), or set it false"
        if self.full_bf16:
            return self._full_bf16_problem()
        return None

    def _full_bf16_problem(self) -> str | None:
        if self.mixed_precision != "bf16":
            return "full_bf16 needs mixed_precision: bf16 (or set full_bf16: null)"
        if self.spec.frozen_base:
            return (f"full_bf16 holds the weights that {' and '.join(names_training('weights'))} train; {self.method} "
                    "trains small tensors kept in float32: set full_bf16: null")
        clash = {"use_8bit_adam": self.use_8bit_adam, "use_ema": self.use_ema,
                 "cpu_backend: ipex": self.cpu_backend == "ipex"}
        if on := [k for k, v in clash.items() if v]:
            return (f"full_bf16 comes with its own optimizer and float32 moments; {', '.join(on)} cannot go with "
                    "it (8-bit moments, a bf16 EMA that loses its updates, IPEX's own float32 master weights): "
                    "set full_bf16: false, or turn those off")
        return None

    def bf16_weights(self, device_type: str) -> bool:
        """Whether the trained weights are held in bf16 (`full_bf16`; null: where measured to win, which
        needs the fused update, so a C++ compiler for torch.compile)."""
        if self.full_bf16 is not None:
            return self.full_bf16
        return (device_type == "cpu" and self.mixed_precision == "bf16" and not self.spec.frozen_base
                and not (self.use_8bit_adam or self.use_ema or self.cpu_backend == "ipex") and bool(cxx_compiler()))

    def _method_problem(self) -> str | None:
        return self.spec.check(self) if self.spec.check else None

    @property
    def spec(self) -> MethodSpec:
        """What `method` is (tasks/train/methods/spec.py)."""
        return method_spec(self.method)

    def _option_problem(self) -> str | None:
        if problem := launch_problem(self.launcher, self.launch):
            return problem
        if self.lr_warmup_steps > self.max_train_steps:
            return "lr_warmup_steps is larger than max_train_steps"
        if self.keep_checkpoints_every_steps and self.keep_checkpoints_every_steps % self.checkpointing_steps:
            return "keep_checkpoints_every_steps must be a multiple of checkpointing_steps"
        if self.scores_checkpoints and self.num_validation_images == 0:
            return ("select_checkpoint best and checkpoint_scoring need validation images to score: set "
                    "num_validation_images > 0, or select_checkpoint: last")
        if self.cache_latents_to_disk and not self.cache_latents:
            return "cache_latents_to_disk needs cache_latents: true"
        mask_options = {"masked_loss_unmasked_weight": self.masked_loss_unmasked_weight,
                        "unmasked_probability": self.unmasked_probability,
                        "normalize_masked_area_loss": self.normalize_masked_area_loss}
        if not self.masked_loss and (on := [k for k, v in mask_options.items() if v]):
            return f"{', '.join(on)} only act(s) with masked_loss: true; set masked_loss: true or remove them"
        if self.cache_text_encoder_outputs_to_disk and not self.cache_text_encoder_outputs:
            return "cache_text_encoder_outputs_to_disk needs cache_text_encoder_outputs: true"
        if self.keep_tokens and not self.shuffle_tag_p:
            return "keep_tokens only matters with shuffle_tag_p > 0"
        if no_ops := config_no_ops(self):
            return "; ".join(no_ops)
        if problem := self._bucket_problem():
            return problem
        if self.resume not in ("latest", "none") and not Path(self.resume).is_dir():
            return (f"resume: {self.resume!r} is not a checkpoint folder; use latest (the newest checkpoint "
                    "of this run, if any), none, or a checkpoint-<step> folder")
        return None

    def _bucket_problem(self) -> str | None:
        if not self.enable_bucket:
            keys = ("min_bucket_reso", "max_bucket_reso", "bucket_reso_steps", "aspect_ratio_buckets")
            if set_keys := [k for k in keys if getattr(self, k) is not None]:
                return f"{', '.join(set_keys)} only matter with enable_bucket: true"
            return None
        try:
            buckets = self.buckets()
        except ValueError as err:
            return f"aspect_ratio_buckets: {err} (write 'h,w;h,w' or a list of [h, w], sides multiples of 8)"
        if bad := [b for b in buckets if b[0] % 8 or b[1] % 8 or min(b) < 8]:
            return f"aspect_ratio_buckets: {bad} are not multiples of 8 (the VAE downsamples by 8)"
        lo, hi, step = self.bucket_shape()
        if self.aspect_ratio_buckets is None and not lo <= self.resolution <= hi:
            return f"min_bucket_reso {lo} <= resolution {self.resolution} <= max_bucket_reso {hi} must hold"
        if self.aspect_ratio_buckets is None and (lo % step or hi % step):
            return f"min_bucket_reso {lo} and max_bucket_reso {hi} must be multiples of bucket_reso_steps {step}"
        return None

    def bucket_shape(self) -> tuple[int, int, int]:
        """(min_bucket_reso, max_bucket_reso, bucket_reso_steps) with the defaults filled in."""
        step = self.bucket_reso_steps or (64 if self.resolution >= 256 else 8)
        lo = self.min_bucket_reso or max(step, self.resolution // 2 // step * step)
        return lo, self.max_bucket_reso or self.resolution * 2, step

    def buckets(self) -> list[tuple[int, int]]:
        """The (height, width) buckets: the fixed list, or kohya's rule from the bucket options."""
        from tasks.train.buckets import kohya_buckets, parse_buckets

        if self.aspect_ratio_buckets is not None:
            return parse_buckets(self.aspect_ratio_buckets)
        return kohya_buckets(self.resolution, *self.bucket_shape())

    def check_family(self, family: Any) -> None:
        """Refuse, before any weights load, a method or option the base model's family does not have."""
        problems = []
        if refusal := self.spec.family_refusal(family):
            problems.append(refusal)
        defaults = type(self).model_fields
        for key, why in family.refused_options().items():
            if getattr(self, key) != defaults[key].default:
                problems.append(f"train.{key}: {why}; remove it or set it to {defaults[key].default}")
        problems += family_no_ops(self, family)
        if self.launcher == "xla" and not family.xla_tested:
            tested = ", ".join(f.title for f in families.FAMILIES if f.xla_tested)
            problems.append(f"train.launcher: xla has been run for {tested} only, not for "
                            f"{family.title}; use local, accelerate or mpirun")
        if self.enable_bucket and (odd := [b for b in self.buckets() if b[0] % family.pixel_multiple
                                           or b[1] % family.pixel_multiple]):
            problems.append(f"train: buckets {odd[:4]} have sides that are not multiples of {family.pixel_multiple}, "
                            f"which {family.title} needs; set bucket_reso_steps (and min/max_bucket_reso) to "
                            f"multiples of {family.pixel_multiple}, or list such aspect_ratio_buckets")
        if problems:
            raise UserError(f"params.yaml: train does not fit the base model ({family.title}): " + "; ".join(problems))

    @property
    def scores_checkpoints(self) -> bool:
        enabled = self.checkpoint_scoring.enabled
        return self.select_checkpoint == "best" if enabled is None else enabled

    def with_scoring_from(self, params: dict[str, Any] | None) -> TrainConfig:
        """This config with `checkpoint_scoring`'s null keys filled from params.yaml's owners."""
        scoring = self.checkpoint_scoring.resolved(params)
        if self.select_checkpoint == "best":
            scoring.scored_metric()  # refuse a metric checkpoints cannot be ranked by, before any load
        return self.model_copy(update={"checkpoint_scoring": scoring})

    def effective_learning_rate(self, num_processes: int) -> float:
        """diffusers' --scale_lr: the LR grows with the images per optimizer step."""
        if not self.scale_lr:
            return self.learning_rate
        return self.learning_rate * self.train_batch_size * self.gradient_accumulation_steps * num_processes
