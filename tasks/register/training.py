"""What a version says it trained: tags and one readable line, from the train stage's report.

reports/train.json names what trained in flat keys, as params.yaml names them (tasks/train/README.md,
"Logged"): the adapter type, rank and alpha, the base's and text encoders' precision, the optimizer,
the images and masks, the concepts. A version carries the main ones as tags `train.<key>` (`train.lora_type`:
dora, `train.rank`: 4, `train.base_model_precision`: int8-torchao, `train.optimizer`: adamw,
`train.mixed_precision`: bf16 with `train.precision_why`: why auto chose it, ...),
`train.masked_loss` (`2 of 3 images (outside the mask weight 0, ...)` or `off`) and `train.concepts`
as a line each, all of them in lineage.json (`train`), and its description says it in one sentence:
"DoRA r4 (alpha 4) on a base held in int8-torchao, bf16 autocast, adamw, 3 images (2 with masks), 1 concept: sks
(3 images x1)".
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tasks.common import adapters
from tasks.common.errors import UserError

#: The report's keys a version is tagged with as they are (`train.<key>`), when the report has them;
#: `train.masked_loss` and `train.concepts` say theirs in a line each.
TAG_KEYS = ("lora_type", "rank", "lora_alpha", "base_model_precision", "text_encoder_precision", "optimizer",
            "instance_images", "edit_pairs", "mixed_precision", "precision_why")
#: How the description writes the `mixed_precision` that ran (train.mixed_precision, auto decided).
COMPUTE_TITLES = {"no": "fp32", "bf16": "bf16 autocast", "fp16": "fp16 autocast"}
#: The report's mask keys (with `masked_loss: true`).
MASK_KEYS = ("masked_images", "masked_loss_unmasked_weight", "unmasked_probability", "normalize_masked_area_loss")


def read_train_report(path: Path) -> dict[str, Any]:
    """The train stage's report; a UserError naming the fix when it is missing or not a JSON object."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path} not found: run the train stage first (`dvc repro train`), or pass the train "
                        "stage's report (--train-report)")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise UserError(f"{path} is not valid JSON: {err}") from err
    if not isinstance(data, dict) or "method" not in data:
        raise UserError(f"{path}: expected the train stage's report (a JSON object with 'method')")
    return data


def _number(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def concepts_line(report: dict[str, Any]) -> str:
    """`name (3 images x2, loss weight 0.5), ...` for the report's concepts; '' when it has none."""
    parts = []
    for name, c in (report.get("concepts") or {}).items():
        images = c.get("images", "?")
        weight = c.get("loss_weight", 1.0)
        parts.append(f"{name} ({images} image{'' if images == 1 else 's'} x{_number(c.get('repeats', 1))}"
                     + (f", loss weight {_number(weight)}" if weight != 1 else "") + ")")
    return ", ".join(parts)


def trained_summary(report: dict[str, Any]) -> dict[str, Any]:
    """The report's keys that say what trained (method, TAG_KEYS, concepts): lineage.json's `train`."""
    keys = ("method", *TAG_KEYS, "train_text_encoder", "masked_loss", *MASK_KEYS, "concepts")
    return {key: report[key] for key in keys if key in report}


def masked_line(report: dict[str, Any]) -> str:
    """`off`, or `2 of 3 images (outside the mask weight 0, unmasked probability 0, area-normalised)`."""
    if not report.get("masked_loss"):
        return "off"
    area = ", area-normalised" if report.get("normalize_masked_area_loss") else ""
    return (f"{report.get('masked_images', '?')} of {report.get('instance_images', '?')} images (outside the mask "
            f"weight {_number(report.get('masked_loss_unmasked_weight', '?'))}, unmasked probability "
            f"{_number(report.get('unmasked_probability', '?'))}{area})")


def train_tags(report: dict[str, Any]) -> dict[str, Any]:
    """`train.<key>` for each of TAG_KEYS the report has, `train.masked_loss` (masked_line) and
    `train.concepts` when it has concepts."""
    tags: dict[str, Any] = {f"train.{key}": report[key] for key in TAG_KEYS if key in report}
    if "masked_loss" in report:
        tags["train.masked_loss"] = masked_line(report)
    if concepts := concepts_line(report):
        tags["train.concepts"] = concepts
    return tags


def trained_line(report: dict[str, Any]) -> str:
    """One sentence of what trained (the module's docstring has an example)."""
    lora_type = report.get("lora_type")
    title = adapters.adapter_type(lora_type).title if lora_type in adapters.TYPES else lora_type
    what = (f"{title} r{report.get('rank', '?')} (alpha "
            f"{_number(report.get('lora_alpha', '?'))})" if lora_type else str(report.get("method", "?")))
    if report.get("train_text_encoder"):
        what += " with the text encoders"
    precision = report.get("base_model_precision", "none")
    line = f"{what} on a base held in {precision}" if precision != "none" else f"{what} on a full-precision base"
    if report.get("text_encoder_precision", "none") != "none":
        line += f" (text encoders {report['text_encoder_precision']})"
    if "mixed_precision" in report:
        line += f", {COMPUTE_TITLES.get(report['mixed_precision'], report['mixed_precision'])}"
    line += f", {report.get('optimizer', 'optimizer unknown')}"
    images = report.get("instance_images")
    if images is not None:
        masks = report.get("masked_images") if report.get("masked_loss") else None
        line += f", {images} image{'' if images == 1 else 's'}" + (f" ({masks} with masks)" if masks else "")
    if edits := report.get("edit_pairs"):
        line += f", {edits} edit pair{'' if edits == 1 else 's'} (targets with reference images)"
    if concepts := concepts_line(report):
        n = len(report["concepts"])
        line += f", {n} concept{'' if n == 1 else 's'}: {concepts}"
    return line
