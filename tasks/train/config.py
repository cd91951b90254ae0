"""The `train` section of params.yaml: what to train; `launcher`/`launch` say where (tasks.common.launch).

Option names are those of diffusers' example scripts (train_dreambooth.py, textual_inversion.py,
train_text_to_image.py and their LoRA variants) where they exist, kohya sd-scripts' otherwise
(`cache_latents`, `keep_tokens`), and the training notes' for tag shuffling (`shuffle_tag_p`).
Every check that can be made without loading a model is made here, at config load, so a bad
setting fails before minutes of loading.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import field_validator, model_validator

from tasks.common import families
from tasks.common.errors import UserError
from tasks.common.safe_remove import own_folder
from tasks.train.concepts import concepts_problem
from tasks.train.method_specs import family_refusal, not_in_run_key, options_models
from tasks.train.no_ops import config_no_ops, family_no_ops
from tasks.train.sections.data import DataSection
from tasks.train.sections.launch import LaunchSection, XlaConfig
from tasks.train.sections.method import MethodSection
from tasks.train.sections.optimizer import OptimizerSection
from tasks.train.sections.outputs import CheckpointScoringConfig, OutputsSection
from tasks.train.sections.precision import (
    PrecisionSection,
    base_precision_problem,
    cxx_compiler,
    text_precision_problem,
)
from tasks.train.sections.schedule import LR_SCHEDULERS, ScheduleSection

#: Keys that do not change what a step computes: a run resumed with other values of these is the
#: same run (e.g. more steps, other checkpoint or validation settings). Every other key is part of
#: the run key that names the checkpoint folder, so `resume: latest` never mixes two runs.
NOT_IN_RUN_KEY = frozenset({
    "max_train_steps", "checkpointing_steps", "checkpoints_total_limit", "keep_checkpoints_every_steps",
    "checkpoints_dir", "resume",
    "validation_prompts", "num_validation_images", "validation_steps", "validation_inference_steps",
    "log_every_steps", "system_metrics_interval", "dataloader_num_workers", "cache_latents",
    "cache_latents_to_disk", "cache_text_encoder_outputs_to_disk", "disk_cache_dir",
    "cache_text_encoder_outputs", "xla",
    # How the processes were started does not change a step; how many there are does (the global
    # batch, the data each rank reads, one RNG file per rank in a checkpoint), so the run key
    # holds the number of processes actually training instead (checkpoints.run_key): a resume
    # must use the same num_processes, whatever the launcher, hosts or threads.
    "launcher", "launch",
    # Which checkpoint becomes the output, and how checkpoints are scored, do not change a step.
    "select_checkpoint", "checkpoint_scoring",
}) | not_in_run_key()  # + the methods' own (e.g. lora's fuse_lora, lora_format: what is written)


#: every registered method's own keys, one options model per method that has any (tasks/train/method_specs/)
METHOD_OPTIONS = options_models()


# The sections in the reverse of their order in docs/parameters.md (pydantic lists the last base's keys
# first): the keys every method reads, by concern, with the methods' own after the data's.
class TrainConfig(LaunchSection, OutputsSection, PrecisionSection, OptimizerSection, ScheduleSection,
                  *reversed(METHOD_OPTIONS), DataSection, MethodSection):  # type: ignore[misc]
    """`train` section: `method` picks what is trained and saved. The keys every method reads are
    defined and checked by concern in tasks/train/sections/ (method, data, schedule, optimizer,
    precision and memory, outputs, launch); the keys one method reads, in that method's options
    model (tasks/train/method_specs/). All are read flat (`cfg.rank`), as params.yaml writes them."""

    @field_validator("checkpoints_dir", "disk_cache_dir")
    @classmethod
    def _own_folders(cls, path: Path, info: Any) -> Path:
        """Folders the stage writes and prunes under: never the repository, an ancestor, / or home."""
        return own_folder(path, {"checkpoints_dir": ".cache/train"}.get(info.field_name, ".cache/encoded"))

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        no_ops = "; ".join(config_no_ops(self)) or None
        problems = [p for p in (self._precision_problem(), self._optimizer_problem(), self._method_problem(),
                                self._launch_problem(), self._schedule_problem(), self._outputs_problem(),
                                self._cache_problem(), self._data_problem(), no_ops, concepts_problem(self),
                                base_precision_problem(self), text_precision_problem(self)) if p]
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def check_family(self, family: Any) -> None:
        """Refuse, before any weights load, a method or option the base model's family does not have."""
        problems = [r for r in (family_refusal(self.spec, family), self.spec.family_problem(self, family)) if r]
        defaults = type(self).model_fields
        for key, why in families.refused_options(family).items():
            if getattr(self, key) != defaults[key].default:
                problems.append(f"train.{key}: {why}; remove it or set it to {defaults[key].default}")
        problems += family_no_ops(self, family)
        if self.with_prior_preservation and (why := families.class_images_refusal(family)):
            problems.append(f"train.with_prior_preservation: {why}; set train.with_prior_preservation: false")
        if self.launcher == "xla" and not family.denoiser.xla_tested:
            tested = ", ".join(f.title for f in families.FAMILIES if f.denoiser.xla_tested)
            problems.append(f"train.launcher: xla has been run for {tested} only, not for "
                            f"{family.title}; use local, accelerate or mpirun")
        multiple = family.codec.pixel_multiple
        if self.enable_bucket and (odd := [b for b in self.buckets() if b[0] % multiple or b[1] % multiple]):
            problems.append(f"train: buckets {odd[:4]} have sides that are not multiples of {multiple}, "
                            f"which {family.title} needs; set bucket_reso_steps (and min/max_bucket_reso) to "
                            f"multiples of {multiple}, or list such aspect_ratio_buckets")
        if problems:
            raise UserError(f"params.yaml: train does not fit the base model ({family.title}): " + "; ".join(problems))


def _refuse_shared_keys() -> None:
    """A method's options model may not redefine a key of the shared sections."""
    shared = {key for base in TrainConfig.__bases__ if base not in METHOD_OPTIONS for key in base.model_fields}
    for model in METHOD_OPTIONS:
        if clash := sorted(shared & set(model.model_fields)):
            raise ValueError(f"{model.__name__} redefines the shared train.* keys {', '.join(clash)}")


_refuse_shared_keys()

__all__ = ["LR_SCHEDULERS", "NOT_IN_RUN_KEY", "CheckpointScoringConfig", "TrainConfig", "XlaConfig", "cxx_compiler"]
