"""Loading a model that runs at ingest (captioner, masker) from the folder `annotate.resolve` found."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from tasks.common.errors import UserError


def load_model(model_class: Any, folder: Path, key: str, name: str, what: str) -> tuple[Any, Any]:
    """(processor, model in eval mode) from a resolved folder; a UserError naming `key` if it is not one."""
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(folder), model_class.from_pretrained(folder).eval()
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UserError(f"{key}: could not load {name!r} from {folder} as {what} with its processor: {err}") from err
