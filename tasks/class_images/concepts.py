"""Class images per concept: `class_images.concepts` makes <out>/<name>/ for each, with its own prompt,
count and seeds, each folder generated, reused and split over ranks exactly as the one set is (core.run).

Concept k's image i is drawn from seed + 100000 k + i (num_images is at most 100000), so no two
concepts share initial noise. Folders this stage made (they hold its generation.json) that params no
longer ask for are removed: the concepts' folders when the run has none, the one set's files when
it has concepts, the folder of a concept no longer listed. Nothing else in <out> is touched.
"""
from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from tasks.class_images.config import ClassImagesConfig
from tasks.class_images.core import _IMAGE, METADATA, STATE, Summary, _nothing, load_pipeline, quantized, run
from tasks.common.errors import UserError
from tasks.common.safe_remove import refusal

log = logging.getLogger(__name__)

SEED_STRIDE = 100_000  # class_images.num_images' ceiling: concept k's seeds start at seed + SEED_STRIDE * k


def concept_config(cfg: ClassImagesConfig, k: int) -> ClassImagesConfig:
    """The one-set config of concept `k`: its prompt, count, negative prompt and seeds."""
    concept = cfg.concepts[k]
    negative = concept.negative_prompt if concept.negative_prompt is not None else cfg.negative_prompt
    return cfg.model_copy(update={"prompt": concept.prompt, "num_images": concept.num_images,
                                  "negative_prompt": negative, "seed": cfg.seed + SEED_STRIDE * k, "concepts": []})


class _LazyPipeline:
    """The base pipeline, loaded at the first image a rank has to make (then shared by every concept)."""

    def __init__(self, base: Path, device: Any, pipe: Any = None, precision: str = "auto",
                 quantize: Any = None) -> None:
        self.base, self.device, self.pipe, self.precision, self.quantize = base, device, pipe, precision, quantize

    def loaded(self) -> Any:
        """The whole pipeline: its text encoders stay for the concepts' prompts (the denoiser quantized
        as class_images.base_model_precision says)."""
        if self.pipe is None:
            self.pipe = load_pipeline(self.base, self.device, self.precision, self.quantize)
        return self.pipe

    @property
    def config(self) -> Any:
        """The pipeline's config and class (what families.of_pipeline reads), loading it if need be."""
        return self.loaded().config

    @property
    def diffusers_class_name(self) -> str:
        return type(self.loaded()).__name__

    def __call__(self, **kwargs: Any) -> Any:
        return self.loaded()(**kwargs)


def run_all(cfg: ClassImagesConfig, base: Path, out_dir: Path, pipe: Any = None, rank: int = 0, world_size: int = 1,
            barrier: Callable[[], None] = _nothing, device: Any = None) -> Summary:
    """The one set in `out_dir` (no concepts), or each concept's in `out_dir/<name>/`; the same arguments
    as core.run. The summary adds up the concepts and keeps each one's in `per_concept`."""
    out_dir = Path(out_dir)
    if rank == 0:
        _prune(out_dir, [c.name for c in cfg.concepts])
    barrier()
    if not cfg.concepts:
        return run(cfg, base, out_dir, pipe, rank, world_size, barrier, device)
    lazy = _LazyPipeline(Path(base), device, pipe, cfg.precision, quantized(cfg))
    per_concept = {c.name: run(concept_config(cfg, k), base, out_dir / c.name, lazy, rank, world_size, barrier, device)
                   for k, c in enumerate(cfg.concepts)}
    parts = list(per_concept.values())
    total = Summary(num_images=sum(p.num_images for p in parts), generated=sum(p.generated for p in parts),
                    reused=sum(p.reused for p in parts), removed=sum(p.removed for p in parts),
                    seconds=sum(p.seconds for p in parts), base_fingerprint=parts[0].base_fingerprint)
    return replace(total, per_concept=per_concept)


def _prune(out_dir: Path, names: list[str]) -> None:
    """Remove what this stage made in `out_dir` that the params no longer ask for (see the module doc)."""
    if not out_dir.is_dir():
        return
    if why := refusal(out_dir):
        raise UserError(f"class images: refusing --out {out_dir}: it {why}; pass a folder of its own")
    for sub in sorted(p for p in out_dir.iterdir() if p.is_dir() and (p / STATE).is_file()):
        if sub.name not in names:
            log.info("removing the class images of concept %r (no longer in class_images.concepts): %s", sub.name, sub)
            shutil.rmtree(sub)
    if names and (out_dir / STATE).is_file():  # the one set of a run without concepts
        for path in out_dir.iterdir():
            if path.is_file() and (_IMAGE.match(path.name) or path.name in (METADATA, STATE)):
                path.unlink()
        log.info("removed the class images of a run without concepts from %s", out_dir)


def image_paths(cfg: ClassImagesConfig, out_dir: Path, limit: int) -> list[Path]:
    """Up to `limit` images for the preview grid, taken evenly from the concepts."""
    from tasks.class_images.core import image_name

    if not cfg.concepts:
        return [out_dir / image_name(i) for i in range(min(cfg.num_images, limit))]
    each = max(1, limit // len(cfg.concepts))
    return [out_dir / c.name / image_name(i) for c in cfg.concepts for i in range(min(c.num_images, each))]


def metadata_files(cfg: ClassImagesConfig, out_dir: Path) -> list[Path]:
    return [out_dir / c.name / METADATA for c in cfg.concepts] if cfg.concepts else [out_dir / METADATA]
