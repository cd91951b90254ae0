"""A method's data: the instance (and class) images, each image's prompt, the batch and the
validation prompts. A mixin of TrainingMethod (tasks/train/methods/base.py), which holds the state."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from tasks.common.errors import UserError
from tasks.train.batch import Batch
from tasks.train.clips import read_clips
from tasks.train.concepts import concept_layout, concept_validation_prompts, log_concepts
from tasks.train.data import Record, TrainDataset, collate, read_imagefolder
from tasks.train.masks import check_masks

log = logging.getLogger(__name__)

INGEST_FIX = "Run the `ingest` stage (dvc repro ingest) with ingest.sources pointing at your images."
CLASS_FIX = ("Run the `class_images` stage (dvc repro class_images) with class_images.num_images > 0, "
             "or set train.with_prior_preservation: false in params.yaml.")


class DataAssembly:
    """Reads the images and assembles each batch (`cfg`, `caption_column`, `captions`, `components`
    are TrainingMethod's)."""

    def prompt(self, record: Record, rng: np.random.Generator) -> str:
        """The prompt of one instance image: the instance prompt, or its caption with the caption rules."""
        if self.caption_column is None:
            return "" if rng.random() < self.cfg.proportion_empty_prompts else self.cfg.instance_prompt
        return self.captions(record, rng)

    def prompts_vary(self) -> bool:
        """True when an image's prompt can change between epochs beyond caption dropout."""
        captioned = self.caption_column is not None or any(c.instance_prompt is None for c in self.cfg.concepts)
        return captioned and self.captions.varies

    def dataset(self, data_dir: Path, class_dir: Path | None, video: bool = False) -> TrainDataset:
        """Instance images (and class images with prior preservation); UserError when inputs are missing.
        An edit dataset with train.caption_column null sets `cfg.caption_column` to 'text' (its instructions):
        the caller reads `self.cfg` after this, so the run key and the report follow what trains.
        `video`: the base is a video model, whose instances are ingest's clips (tasks/train/clips.py)."""
        column = self.caption_column or "text"
        instances = (read_clips(data_dir, "instance clips", INGEST_FIX, column, Record) if video
                     else read_imagefolder(data_dir, "instance images", INGEST_FIX, column))
        edits = self.caption_column is None and self.cfg.spec.reads_captions and any(r.references for r in instances)
        if edits:  # an edit dataset: each target trains on its instruction (its caption), not the instance prompt
            self.cfg = self.cfg.model_copy(update={"caption_column": "text"})
            self.caption_column = "text"
        self.sample_captions = [r.text for r in instances[:4]]
        #: the first target's reference files, which an edit model's validation images edit (validation.py)
        self.sample_references = list(instances[0].references) if instances and instances[0].references else []
        self.concept_prompts = concept_validation_prompts(self.cfg, instances)
        self.instance_texts = {r.text for r in instances}
        classes, layout = None, None
        if self.cfg.concepts:  # several concepts: each its prompts, class images, repeats and weight
            layout, classes, self.class_files = concept_layout(self.cfg, instances, data_dir, class_dir, self.captions)
        elif self.cfg.with_prior_preservation:
            classes = self._class_images(class_dir, len(instances))
        prompts = (f"each target's instruction, column {self.caption_column!r}: an edit dataset, train.caption_column "
                   "null" if edits else f"column {self.caption_column!r}" if self.caption_column
                   else repr(self.cfg.instance_prompt))
        log.info("%s data: %d instance %s (prompts: %s)%s", self.name, len(instances), "clips" if video else "images",
                 prompts, f", {len(classes)} class images" if classes else "")
        dataset = TrainDataset(instances, classes, self.prompt, self.cfg.class_prompt, self.cfg.resolution,
                               self.cfg.center_crop, self.cfg.random_flip, self.cfg.seed,
                               self.cfg.buckets() if self.cfg.enable_bucket else None, layout)
        log_concepts(self.cfg, dataset)
        if dataset.buckets:
            log.info("aspect-ratio buckets (height x width: instance images): %s",
                     ", ".join(f"{k}: {v}" for k, v in dataset.bucket_counts().items()))
        dataset.masked, dataset.unmasked_probability = check_masks(self.cfg, instances)
        return dataset

    def _class_images(self, class_dir: Path | None, instances: int) -> list[Record]:
        """Prior preservation's class images (one concept), with a warning where they do not match."""
        if class_dir is None or not Path(class_dir).is_dir():
            raise UserError(f"prior preservation is on but the class images folder {class_dir} does not exist. "
                            f"{CLASS_FIX}")
        classes = read_imagefolder(class_dir, "class images", CLASS_FIX)
        made_with = {r.text for r in classes} - {""}
        if made_with and made_with != {self.cfg.class_prompt}:
            log.warning("train.class_prompt %r differs from the prompt the class images were made with (%s); "
                        "set them equal (class_images.prompt)", self.cfg.class_prompt,
                        ", ".join(sorted(map(repr, made_with))))
        if len(classes) < instances:
            log.warning("only %d class images for %d instance images; the DreamBooth paper uses ~200",
                        len(classes), instances)
        return classes

    def collate(self, examples: list[dict[str, Any]]) -> Batch:
        batch = collate(examples)
        text = self.components.family.text
        batch.input_ids = text.tokenize(self.components, batch.prompts, self.cfg.max_sequence_length)
        return batch

    def validation_prompts(self) -> list[str]:
        """Prompts of the validation images when train.validation_prompts is null."""
        if self.concept_prompts:
            return self.concept_prompts
        if self.caption_column is not None and self.sample_captions:
            return self.sample_captions[:1]
        return [self.cfg.instance_prompt]
