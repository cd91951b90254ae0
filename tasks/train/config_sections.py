"""The `train` section's two sub-sections (`train.xla`, `train.checkpoint_scoring`) and its quantized-base check."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from tasks.common.config import StageConfig
from tasks.common.errors import UserError
from tasks.common.quantize import BasePrecision
from tasks.common.scoring import IMAGE_METRICS
from tasks.train.methods.spec import method_spec, names_training

#: What `train.checkpoint_scoring` follows when a key is null: (section, key, default when absent).
#: The train stage reads its own section; these keys are read from params.yaml as well (and
#: dvc.yaml lists them among the train stage's params), so the evaluation protocol and the
#: registry's metric are stated once.
SCORING_FOLLOWS = {
    "metric": ("register", "primary_metric", "dino"),
    "goal": ("register", "primary_metric_goal", "maximize"),
    "identifier": ("evaluate", "identifier", "sks"),
    "clip_model": ("evaluate", "clip_model", "builtin:tiny-clip"),
    "clip_revision": ("evaluate", "clip_revision", None),
    "dino_model": ("evaluate", "dino_model", "builtin:tiny-dino"),
    "dino_revision": ("evaluate", "dino_revision", None),
    "encoder_seed": ("evaluate", "encoder_seed", 0),
}


class XlaConfig(StageConfig):
    """`train.xla`: PyTorch/XLA (TPU, or CPU with PJRT_DEVICE=CPU) options, after diffusers' SDXL-on-TPU script."""

    mesh_shape: list[int] | None = Field(
        None, min_length=1, max_length=2,
        description="SPMD device mesh (data[, model]); the batch is sharded over its first axis. "
                    "null: every device on one data axis (data parallel)",
    )
    compile_cache_dir: Path | None = Field(
        Path(".cache/xla"), description="persistent XLA compile cache (its CACHE_DIR); null: none"
    )
    profile_dir: Path | None = Field(None, description="write an XLA profile trace here (its PROFILE_DIR); null: off")
    profile_start_step: int = Field(10, ge=1, description="first optimizer step inside the profile window")
    profile_steps: int = Field(5, ge=1, description="optimizer steps the profile window covers")
    loader_prefetch_size: int = Field(1, ge=1, description="batches the host loader keeps ready")
    device_prefetch_size: int = Field(1, ge=1, description="batches already sent to the devices")


class CheckpointScoringConfig(StageConfig):
    """`train.checkpoint_scoring`: the validation images of every checkpoint scored as `evaluate` scores.

    A null key follows its owner in params.yaml (SCORING_FOLLOWS): the metric and its goal are
    `register.primary_metric` / `primary_metric_goal`, the encoders and the identifier (left out
    of CLIP-T's text) are `evaluate`'s. `resolved()` fills them in.
    """

    enabled: bool | None = Field(None, description="score each checkpoint; null: when select_checkpoint is best")
    metric: str | None = Field(None, min_length=1, description="clip_t | clip_i | dino (gain_<m>: <m>); "
                                                                "null: register.primary_metric")
    goal: Literal["maximize", "minimize"] | None = Field(None, description="null: register.primary_metric_goal")
    identifier: str | None = Field(None, min_length=1, description="null: evaluate.identifier")
    clip_model: str | None = Field(None, min_length=1, description="null: evaluate.clip_model")
    clip_revision: str | None = Field(None, description="null: evaluate.clip_revision")
    dino_model: str | None = Field(None, min_length=1, description="null: evaluate.dino_model")
    dino_revision: str | None = Field(None, description="null: evaluate.dino_revision")
    encoder_seed: int | None = Field(None, ge=0, description="null: evaluate.encoder_seed")

    def resolved(self, params: dict[str, Any] | None = None) -> CheckpointScoringConfig:
        """Every null key filled from its owner in `params` (the whole params.yaml), else its default."""
        values = self.model_dump()
        sources = {}
        for key, (section, owner_key, default) in SCORING_FOLLOWS.items():
            if values[key] is None:
                owner = (params or {}).get(section) or {}
                values[key] = owner.get(owner_key, default) if isinstance(owner, dict) else default
                sources[key] = f"{section}.{owner_key}"
        try:
            return CheckpointScoringConfig.model_validate(values)
        except ValueError as err:
            raise UserError(f"params.yaml: train.checkpoint_scoring (null keys follow {', '.join(sources.values())})"
                            f": {err}") from None

    def scored_metric(self) -> str:
        """The image metric checkpoints are ranked by (call on a resolved config)."""
        metric = str(self.metric)
        name = metric.removeprefix("gain_")  # ranks like <m>: the base's score is the same for every checkpoint
        if name not in IMAGE_METRICS:  # what a checkpoint's validation images can be scored on
            raise UserError(
                f"train.checkpoint_scoring.metric is {metric!r} (null follows register.primary_metric), which a "
                f"checkpoint's validation images cannot be scored on; set train.checkpoint_scoring.metric to one of "
                f"{', '.join(IMAGE_METRICS)}")
        return name


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
    return precision.problem(adapter=cfg.lora_type if spec.trains == "adapters" else None)


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
