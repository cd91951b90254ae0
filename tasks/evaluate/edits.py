"""The edit set: (reference images, target, instruction) triples, each edit scored against its target.

An edit dataset's targets list their references in metadata.jsonl (`reference_file_names`, written
by ingest under `references/`); the caption is the instruction. The first `evaluate.edits.max_pairs`
triples go through the fine-tune and the base, one call per triple: its references as the pipeline's
`image`, its instruction as the prompt, at the target's size, from the latents of `evaluate.seed`
(the same for both models, so their edits differ only by the model). Each edit is scored with the
protocol's encoders (tasks/common/scoring.py's Scorer, the target as the one real image): DINO and
CLIP-I to its target, CLIP-T to its instruction; the means are `edit_dino`, `edit_clip_i`,
`edit_clip_t` (with `base_edit_*` and `gain_edit_*` when the base is compared).
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image
from tqdm import tqdm

from tasks.common import families
from tasks.common.errors import UserError
from tasks.common.images import to_rgb
from tasks.common.scoring import IMAGE_METRICS, Encoders, Scorer, clip_t_text
from tasks.evaluate.generate import initial_latents
from tasks.evaluate.protocol import images_hash

log = logging.getLogger(__name__)

#: The edit set's metrics, each the mean over the triples of a per-edit score (edit_<image metric>).
EDIT_METRICS = tuple(f"edit_{name}" for name in IMAGE_METRICS)


@dataclass(frozen=True)
class Triple:
    """One edit: the target (its file name in the processed folder), instruction and reference images."""

    name: str
    instruction: str
    target: Image.Image
    reference_names: tuple[str, ...]
    references: tuple[Image.Image, ...]


def _open(path: Path) -> Image.Image:
    with Image.open(path) as im:
        return to_rgb(im).copy()


def load_triples(folder: Path, limit: int) -> list[Triple]:
    """The first `limit` rows of `folder/metadata.jsonl` that list reference images (none: not an edit set)."""
    meta = Path(folder) / "metadata.jsonl"
    if not meta.is_file():
        return []
    triples: list[Triple] = []
    for line_no, line in enumerate(meta.read_text(encoding="utf-8").splitlines(), 1):
        if len(triples) >= limit:
            break
        row = json.loads(line) if line.strip() else {}
        names = tuple(row.get("reference_file_names") or ())
        if not names:
            continue
        missing = [n for n in (row["file_name"], *names) if not (folder / n).is_file()]
        if missing:
            raise UserError(f"evaluate: {meta}:{line_no} lists {', '.join(missing)}, which are missing; rerun "
                            "the ingest stage (dvc repro ingest), or set evaluate.edits.enabled: false")
        triples.append(Triple(row["file_name"], str(row.get("text") or ""), _open(folder / row["file_name"]),
                              names, tuple(_open(folder / n) for n in names)))
    return triples


def set_hash(triples: list[Triple]) -> str:
    """A content hash of the edit set (targets, references and instructions, in order): the protocol's."""
    texts = json.dumps([[t.instruction, len(t.references)] for t in triples])
    pixels = images_hash([image for t in triples for image in (t.target, *t.references)])
    return hashlib.sha256((texts + pixels).encode()).hexdigest()[:16]


def refuse_family(family: Any, triples: list[Triple]) -> None:
    """A family without reference inputs would edit text-to-image from the instructions, one that takes
    fewer than a triple has would drop some: refused."""
    most = family.call_convention().input_images
    if family.inputs.trains and (over := [t.name for t in triples if len(t.references) > most]):
        raise UserError(
            f"evaluate: the edit set's {', '.join(over)} list more than {most} reference image(s), which "
            f"{family.title} takes at most; ingest an edit set with at most {most}, or set "
            "evaluate.edits.enabled: false")
    if triples and not family.inputs.trains:
        raise UserError(
            f"evaluate: the instance data is an edit dataset ({len(triples)} targets list reference images, "
            f"metadata.jsonl `reference_file_names`), but {family.title} does not take reference images, so "
            "its edits would be text-to-image from the instructions alone; set evaluate.edits.enabled: false "
            "to evaluate it without the edit set, or evaluate a family that takes references (FLUX.2 [klein])")


def refuse_no_input(family: Any, triples: list[Triple], instance_data: Any) -> None:
    """A family that makes no image from a prompt alone (Qwen-Image-Edit) is evaluated on an edit set:
    its fidelity prompts edit the set's first reference (phases._jobs); without one, refused."""
    if family.call_convention().min_input_images and not triples:
        raise UserError(
            f"evaluate: {family.title} makes no image from a prompt alone, and {instance_data} is not an edit "
            "dataset (no metadata.jsonl `reference_file_names`), or evaluate.edits.enabled is false; evaluate it "
            "on its edit dataset with evaluate.edits.enabled: true (its prompts then edit the first reference)")


def generate(pipe: Any, triples: list[Triple], *, seed: int, num_inference_steps: int, guidance_scale: float,
             desc: str) -> tuple[list[list[Image.Image]], float]:
    """images[i] = [the edit of triple i] (one call each, at its target's size, from seed's latents), seconds."""
    pipe.set_progress_bar_config(disable=True)
    family = families.of_pipeline(pipe)
    refuse_family(family, triples)
    images: list[list[Image.Image]] = []
    start = time.perf_counter()
    for t in tqdm(triples, desc=desc, unit="edit", disable=None):
        width, height = t.target.size
        try:
            out = family.generate(pipe, [t.instruction], image=list(t.references), height=height, width=width,
                                  latents=initial_latents([seed], pipe, height, width), steps=num_inference_steps,
                                  guidance=guidance_scale, output_type="pil")
        except ValueError as err:  # the pipeline's checks of its image inputs (size, aspect ratio)
            raise UserError(f"evaluate: {family.title}'s pipeline refused the edit of {t.name} (references "
                            f"{', '.join(t.reference_names)}): {err}; ingest the edit dataset at a size it takes "
                            "(ingest.resolution), or set evaluate.edits.enabled: false") from None
        images.append(list(out[:1]))
    seconds = time.perf_counter() - start
    log.info("%s: %d edits in %.1f s", desc, len(images), seconds)
    return images, seconds


def scores(encoders: Encoders, triples: list[Triple], tuned: list[list[Image.Image]],
           base: list[list[Image.Image]] | None,
           identifier: str | None) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """edit_* (and base_edit_*, gain_edit_*) means, and one row per triple with its scores beside the base's."""
    sums: dict[str, float] = {}
    rows = []
    for i, t in enumerate(triples):
        text = clip_t_text(t.instruction, identifier)
        scorer = Scorer(encoders.clip, encoders.dino, encoders.clip.embed_texts([text]), [t.target])
        row: dict[str, Any] = {"target": t.name, "instruction": t.instruction, "clip_t_text": text,
                               "references": " ".join(t.reference_names)}
        mine = scorer.scores([tuned[i]])[0]
        theirs = scorer.scores([base[i]])[0] if base is not None else None
        for name in IMAGE_METRICS:
            row[name] = round(mine[name], 6)
            sums[f"edit_{name}"] = sums.get(f"edit_{name}", 0.0) + mine[name]
            if theirs is not None:
                row[f"{name}_base"] = round(theirs[name], 6)
                sums[f"base_edit_{name}"] = sums.get(f"base_edit_{name}", 0.0) + theirs[name]
        rows.append(row)
    metrics = {k: v / len(triples) for k, v in sums.items()}
    if base is not None:
        metrics.update({f"gain_{k}": metrics[k] - metrics[f"base_{k}"] for k in EDIT_METRICS})
    return metrics, rows


def grid_cells(triples: list[Triple], tuned: list[list[Image.Image]],
               base: list[list[Image.Image]] | None) -> tuple[list[Image.Image], int]:
    """One grid row per triple: its references (blank where it has fewer), target, fine-tune's and base's edit."""
    width = max(len(t.references) for t in triples)
    cells = []
    for i, t in enumerate(triples):
        blank = [Image.new("RGB", (1, 1), (255, 255, 255))] * (width - len(t.references))
        cells += [*t.references, *blank, t.target, *tuned[i], *(base[i] if base is not None else [])]
    return cells, width + 2 + (base is not None)
