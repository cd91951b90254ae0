"""What a run trained, as reports/train.json says it (flat keys, named as params.yaml names them).

The registry tags and describes a version from these keys (tasks/register/training.py), so a
version says DoRA, not only `method: lora`, and how many of its images trained masked:

- `lora_type`, `rank`, `lora_alpha` (null in params.yaml: the rank, as peft uses it), `lora_format`
  (comfyui: the output also has comfyui_lora.safetensors): for a method that reads them
  (tasks/train/method_specs/);
- `optimizer`: what make_optimizer built (tasks/train/optim.py `optimizer_name`);
- `instance_images`: the instance images of the data; `edit_pairs`, on an edit dataset: the targets
  trained with reference images; `caption_column`: the metadata column the prompts came from (an
  edit dataset's `text`, its instructions, also where params.yaml left it null), null where every
  image trained with `instance_prompt` (or textual inversion's templates); `masked_loss`, and with
  it `masked_images` (those whose mask weighs the loss) and the mask settings;
- the report's own `base_model_precision`, `text_encoder_precision` (what the base held) and
  `concepts` (per concept: images, repeats, loss weight) are written beside them (core.py).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: The LoRA keys a method may read, in the report's order.
ADAPTER_KEYS = ("lora_type", "rank", "lora_alpha", "lora_format")
#: The mask settings reported with `masked_loss: true`.
MASK_KEYS = ("masked_loss_unmasked_weight", "unmasked_probability", "normalize_masked_area_loss")


def trained_settings(cfg: Any, instances: Sequence[Any], optimizer: str) -> dict[str, Any]:
    """The report's keys saying what `cfg` trained on `instances` (the data's rows) with `optimizer`."""
    options = cfg.spec.options
    out: dict[str, Any] = {key: getattr(cfg, key) for key in ADAPTER_KEYS if key in options}
    if "lora_alpha" in out and out["lora_alpha"] is None:
        out["lora_alpha"] = float(cfg.rank)
    out["train_text_encoder"] = cfg.train_text_encoder
    out["optimizer"] = optimizer
    out["instance_images"] = len(instances)
    out["caption_column"] = (cfg.caption_column or cfg.spec.default_caption_column) if cfg.spec.reads_captions else None
    if edits := sum(bool(getattr(r, "references", ())) for r in instances):
        out["edit_pairs"] = edits
    out["masked_loss"] = cfg.masked_loss
    if cfg.masked_loss:
        out["masked_images"] = sum(r.mask is not None for r in instances)
        out.update({key: getattr(cfg, key) for key in MASK_KEYS})
    return out
