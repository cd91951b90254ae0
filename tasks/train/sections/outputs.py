"""What a run leaves and shows: checkpoints (never lose progress), resuming, which checkpoint
becomes the output and how checkpoints are scored (`train.checkpoint_scoring`), validation
images, metrics."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from tasks.common.config import StageConfig
from tasks.common.errors import UserError
from tasks.common.scoring import IMAGE_METRICS

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


class OutputsSection(StageConfig):
    # checkpoints
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
    # validation and metrics
    validation_prompts: list[str] | None = Field(None, description="null: the method's training prompt")
    num_validation_images: int = Field(4, ge=0, le=64, description="images per validation prompt (0: none)")
    validation_steps: int = Field(0, ge=0, description="validation images every N steps (0: only at the end)")
    validation_inference_steps: int = Field(10, ge=1, le=1000, description="denoising steps per validation image")
    log_every_steps: int = Field(1, ge=1, description="MLflow metrics every N steps (the CSV has every step)")
    system_metrics_interval: float = Field(5, ge=0, description="MLflow system metrics every N seconds (0: off)")

    def _outputs_problem(self) -> str | None:
        if self.keep_checkpoints_every_steps and self.keep_checkpoints_every_steps % self.checkpointing_steps:
            return "keep_checkpoints_every_steps must be a multiple of checkpointing_steps"
        if self.scores_checkpoints and self.num_validation_images == 0:
            return ("select_checkpoint best and checkpoint_scoring need validation images to score: set "
                    "num_validation_images > 0, or select_checkpoint: last")
        if self.resume not in ("latest", "none") and not Path(self.resume).is_dir():
            return (f"resume: {self.resume!r} is not a checkpoint folder; use latest (the newest checkpoint "
                    "of this run, if any), none, or a checkpoint-<step> folder")
        return None

    @property
    def scores_checkpoints(self) -> bool:
        enabled = self.checkpoint_scoring.enabled
        return self.select_checkpoint == "best" if enabled is None else enabled

    def with_scoring_from(self, params: dict[str, Any] | None) -> Any:
        """This config with `checkpoint_scoring`'s null keys filled from params.yaml's owners."""
        scoring = self.checkpoint_scoring.resolved(params)
        if self.select_checkpoint == "best":
            scoring.scored_metric()  # refuse a metric checkpoints cannot be ranked by, before any load
        return self.model_copy(update={"checkpoint_scoring": scoring})
