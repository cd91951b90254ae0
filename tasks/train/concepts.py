"""Several concepts in one run: which image each example index shows, with which class image and weight.

A concept (kohya's subset, OneTrainer's concept) is the rows of data/processed whose `concept` is its
name, with its own instance prompt (or the rows' captions), class prompt and class images
(data/class_images/<name>/), repeats and loss weight. The dataset is laid out as one group per
concept, one after the other: a group of n images shown r times each with k class images is
max(n * r, k) examples long; its example j shows image j mod n (of the n * r slots) and class image
j mod k of ITS concept, so each concept's prior loss is over its own class. With `train.concepts`
empty there is one group of every row (each row repeated as ingest said, 1 for older datasets):
with no repeats that is the plain dataset, example j showing image j mod n and class image j mod k.

The layout is a pure function of the rows and params, so the epoch sampler's permutation, exact
resume and the per-example generators (tasks/train/data.py) are unchanged by it.
"""
from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pydantic import Field

from tasks.common.concepts import ConceptName
from tasks.common.config import StageConfig
from tasks.common.errors import UserError
from tasks.train.layout import Group, Layout, repeated
from tasks.train.method_specs import method_spec

log = logging.getLogger(__name__)


class ConceptConfig(StageConfig):
    """One entry of `train.concepts`: a dataset trained beside others in the run (tasks/train/README.md, Concepts)."""

    name: ConceptName = Field(description="the rows' `concept` (ingest: a source's `concept`, or a kohya "
                                          "folder's name)")
    instance_prompt: str | None = Field(
        None, min_length=1, description="prompt of every image of the concept; null: the rows' captions "
                                        "(train.caption_column, else 'text'), with the caption rules")
    class_prompt: str | None = Field(
        None, min_length=1, description="prompt of its class images (data/class_images/<name>/, made by "
                                        "class_images.concepts); needed with prior preservation")
    loss_weight: float = Field(1.0, ge=0.0,
                               description="its examples' losses (instance and class) are multiplied by it")
    repeats: int | None = Field(None, ge=1, le=10_000,
                                description="times an epoch shows each of its images; null: the rows' (ingest's)")


def concepts_problem(cfg: Any) -> str | None:
    """What is wrong with `train.concepts` given the rest of `train` (`cfg`), or None."""
    names = [c.name for c in cfg.concepts]
    if twice := sorted({n for n in names if names.count(n) > 1}):
        return f"concepts: {', '.join(map(repr, twice))} listed twice; name each concept once"
    if cfg.concepts and not method_spec(cfg.method).concepts:
        able = [n for n in names() if method_spec(n).concepts]
        return (f"concepts: {cfg.method} learns one concept; train several concepts with {', '.join(able)}, "
                "or set concepts: []")
    if cfg.with_prior_preservation and (missing := [c.name for c in cfg.concepts if c.class_prompt is None]):
        return (f"concepts: {', '.join(map(repr, missing))} without class_prompt, but prior preservation is on: "
                "give each concept the class_prompt of its class images (as in class_images.concepts), or set "
                "with_prior_preservation: false")
    return None


def rows_by_concept(records: Sequence[Any]) -> dict[str | None, list[int]]:
    """Instance indices per row concept (None: rows without one), in row order."""
    out: dict[str | None, list[int]] = {}
    for i, record in enumerate(records):
        out.setdefault(record.concept, []).append(i)
    return out


def check_rows(cfg: Any, records: Sequence[Any], data_dir: Path) -> dict[str, list[int]]:
    """{concept: its instance indices} for train.concepts; a UserError for a concept without rows or
    rows of no listed concept (training them silently, or dropping them silently, would surprise)."""
    by = rows_by_concept(records)
    have = sorted(str(k) for k in by if k is not None)
    listed = [c.name for c in cfg.concepts]
    fix = ("Concepts come from ingest: a source's `concept`, or a folder source with kohya_folders: true "
           "(sub-folders `<repeats>_<name>`)")
    if missing := [n for n in listed if n not in by]:
        raise UserError(f"train.concepts: {', '.join(map(repr, missing))} has no images in {data_dir} (its "
                        f"concepts: {', '.join(map(repr, have)) or 'none'}). {fix}; or correct the name.")
    if extra := [k for k in by if k not in listed]:
        what = ", ".join("rows without a concept" if k is None else repr(k) for k in extra)
        raise UserError(f"train.concepts does not list {what} of {data_dir}: list every concept the data has "
                        f"({', '.join(map(repr, have))}), or leave them out at ingest. {fix}.")
    return {n: by[n] for n in listed}


def class_folder(class_dir: Path, name: str) -> Path:
    """Where the class images of concept `name` lie (class_images.concepts writes them there)."""
    return Path(class_dir) / name


def concept_layout(cfg: Any, records: Sequence[Any], data_dir: Path, class_dir: Path | None,
                   captions: Callable[..., str]) -> tuple[Layout, list[Any], list[Path]]:
    """The layout of train.concepts, the class images of all concepts (one after another) and the
    metadata files they come from. `captions` is the caption rule for concepts without instance_prompt."""
    from tasks.train.data import METADATA, read_imagefolder  # torch: not at config load

    rows = check_rows(cfg, records, data_dir)
    groups, classes, files = [], [], []
    for concept in cfg.concepts:
        indices = rows[concept.name]
        class_indices: tuple[int, ...] = ()
        if cfg.with_prior_preservation:
            if class_dir is None:
                raise UserError("prior preservation is on, but no class images folder was given (--class-data); "
                                "pass it, or set train.with_prior_preservation: false")
            folder = class_folder(Path(class_dir), concept.name)
            fix = (f"List concept {concept.name!r} in class_images.concepts (with prompt {concept.class_prompt!r}) "
                   "and run the `class_images` stage (dvc repro class_images), or set train.with_prior_preservation: "
                   "false.")
            own = read_imagefolder(folder, f"class images of concept {concept.name!r}", fix)
            class_indices = tuple(range(len(classes), len(classes) + len(own)))
            classes += own
            files.append(folder / METADATA)
        repeats = [concept.repeats or records[i].repeats for i in indices]
        groups.append(Group(concept.name, repeated(indices, repeats), class_indices, _prompt(concept, cfg, captions),
                            concept.class_prompt, concept.loss_weight))
    return Layout(groups), classes, files


def _prompt(concept: ConceptConfig, cfg: Any, captions: Callable[..., str]) -> Callable[..., str]:
    """A concept's prompt rule: its instance prompt (with caption dropout), else the rows' captions."""
    if concept.instance_prompt is None:
        return captions
    text, dropout = concept.instance_prompt, cfg.proportion_empty_prompts

    def prompt(record: Any, rng: Any) -> str:
        return "" if rng.random() < dropout else text

    return prompt


def examples_report(layout: Layout, records: Sequence[Any], seen: Counter) -> dict[str, dict[str, Any]]:
    """Per concept (the rows' names): images, repeats, examples per epoch and examples seen."""
    out: dict[str, dict[str, Any]] = {}
    for group in layout.groups:
        per_epoch = Counter(records[group.slots[j % len(group.slots)]].concept for j in range(len(group)))
        for name, count in per_epoch.items():
            if name is None:
                continue
            images = len({i for i in group.slots if records[i].concept == name})
            repeats = sum(records[i].concept == name for i in group.slots) / images
            out[name] = {"images": images, "repeats": round(repeats, 3), "examples_per_epoch": count,
                         "class_images": len(group.classes) if group.name is not None else 0,
                         "loss_weight": group.loss_weight, "examples_seen": int(seen.get(name, 0))}
    return dict(sorted(out.items()))


def concept_prompts(cfg: Any, captions: set[str]) -> set[str]:
    """Every prompt the concepts can give (for the text cache): instance prompts or the captions, class prompts."""
    prompts: set[str] = set()
    for concept in cfg.concepts:
        prompts |= {concept.instance_prompt} if concept.instance_prompt else captions
        if cfg.with_prior_preservation and concept.class_prompt:
            prompts.add(concept.class_prompt)
    return prompts


def log_concepts(cfg: Any, dataset: Any) -> None:
    """Say how the concepts are laid out, or that the data's concepts train as one."""
    report = examples_report(dataset.layout, dataset.instances, Counter())
    if cfg.concepts:
        log.info("concepts: %s", "; ".join(
            f"{name!r}: {r['images']} images x{r['repeats']:g} = {r['examples_per_epoch']} examples per epoch, "
            f"{r['class_images']} class images, loss weight {r['loss_weight']:g}" for name, r in report.items()))
    elif report:
        log.warning("the data has concepts %s but train.concepts is empty: they train as one dataset (repeats as "
                    "ingest said, train.instance_prompt or the captions, one set of class images); list them in "
                    "train.concepts for a prompt, class images and loss weight each", ", ".join(map(repr, report)))


def concept_validation_prompts(cfg: Any, records: Sequence[Any]) -> list[str]:
    """One validation prompt per concept of train.concepts: its instance prompt, else its first caption."""
    first = {r.concept: r.text for r in reversed(records) if r.concept is not None}
    return [c.instance_prompt or first.get(c.name, "") for c in cfg.concepts]


def weighted(losses: Any, batch: Any, seen: Counter) -> Any:
    """Per-example `losses` times each row's concept loss weight (train.concepts.*.loss_weight; a Batch
    has `loss_weights` only where one is not 1); the batch's instance examples are counted in `seen`."""
    seen.update(c for c in batch.concepts if c is not None)
    if batch.loss_weights is None:
        return losses
    return losses * batch.loss_weights.to(losses.device, losses.dtype)
