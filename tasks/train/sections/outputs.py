"""What a run leaves and shows: checkpoints (never lose progress), resuming, which checkpoint
becomes the output, validation images, metrics."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from tasks.common.config import StageConfig
from tasks.train.config_sections import CheckpointScoringConfig


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
