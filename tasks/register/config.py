"""The `register` section of params.yaml."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from tasks.common.config import StageConfig


class RegisterConfig(StageConfig):
    """Where the model goes in the MLflow registry, and when it becomes `champion`.

    `model_name` null (the default): the name follows what was trained (tasks/register/naming.py).
    Every registered version gets `candidate`. `champion` moves to it only when the evaluation
    gate passed AND it beats the current champion on `primary_metric` (strictly: a tie keeps the
    champion, so re-registering the same model never churns the alias). `serve_*` become the
    model's `model_config` (finetune_runtime/limits.py SERVING_DEFAULTS, same defaults): its serving limits.
    """

    model_name: str | None = Field(
        None,
        min_length=1,
        max_length=256,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
        description="registered model name; letters, digits, '.', '_' and '-'. null: the name follows "
                    "what was trained, `<family>-<method>` (`sd-dreambooth`, `zimage-lora`; `-edit` before "
                    "the method for an edit set: `kontext-edit-lora`), one name per lineage of comparable "
                    "models (tasks/register/naming.py). Whatever the name, a version of another family or "
                    "task than the champion's is never ranked against it",
    )
    primary_metric: str = Field(
        "dino",
        min_length=1,
        description="a key of reports/evaluate.json's metrics (clip_t, clip_i, dino, gain_dino, ...)",
    )
    primary_metric_goal: Literal["maximize", "minimize"] = Field(
        "maximize", description="whether a higher (maximize) or a lower primary_metric is better"
    )
    serve_budget_images: float = Field(
        4.0,
        gt=0,
        allow_inf_nan=False,
        description="the most one request to the served model may cost, in images at the model's "
                    "default size and steps (cost: prompts x num_images_per_prompt x num_inference_steps "
                    "x height x width); over it, HTTP 400 naming the fields and the budget",
    )
    serve_max_waiting: int = Field(
        4,
        ge=0,
        le=64,
        description="requests that may wait for the served model (per worker) while it generates; "
                    "the next gets HTTP 429 with retry_after_s",
    )
    serve_adapter_cache_mb: float = Field(
        1024.0,
        gt=0,
        allow_inf_nan=False,
        description="a base export's endpoint (export.adapters: runtime): the most disk, in MB, its "
                    "downloaded adapters take (one cache folder per worker; the least recently used "
                    "version is deleted to make room, at most 8 versions are kept)",
    )
    serve_adapter_models: list[Annotated[str, Field(min_length=1, max_length=256,
                                                    pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")]] | None = Field(
        None, min_length=1,
        description="a base export's endpoint (export.adapters: runtime): the registered models whose versions "
                    "a request may name as `adapter` (any other gets HTTP 400 naming `adapter`); null: the one "
                    "model this pipeline registers the base's fine-tunes under (`<model>` of `<model>-base`). "
                    "Recorded in the base export's model_config (`adapter_models`) when it is registered, by the "
                    "first fine-tune of that base",
    )
    base_copy_max_gb: float | None = Field(
        4.0,
        ge=0,
        allow_inf_nan=False,
        description="adapters registered unfused (train.fuse_lora: false) are registered with their base: "
                    "a base folder of at most this many GB is copied into the version; a larger one is "
                    "registered by reference (its name, revision, DVC hash, path and file sizes; "
                    "finetune_runtime/base_reference.py); null: always copied",
    )
    rescore_timeout_min: float | None = Field(
        240.0,
        gt=0,
        allow_inf_nan=False,
        description="the most minutes the flow gives the re-score of a champion scored under another "
                    "evaluation protocol (flows/rescore.py); past it the evaluate command is stopped and, as "
                    "for any failed re-score, the candidate is registered, the champion holds and the "
                    "candidate's champion.rescore_error says why; null: no limit",
    )
    promote_uncalibrated: bool = Field(
        False,
        description="let `champion` move on uncalibrated scores (random-weight built-in "
                    "encoders, e.g. the offline demo): an explicit choice, never a default",
    )
