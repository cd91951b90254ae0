"""The `ingest.captioner` and `ingest.masker` sections: models run over the kept images (off by default).

Both name a transformers model as `builtin:tiny-...` (built locally, for tests and offline demos),
a local folder saved with `save_pretrained`, or a hub id with `revision` pinned to a commit.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from tasks.common.config import StageConfig

HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
COMMIT = re.compile(r"^[0-9a-f]{40}$")
#: Salesforce/blip-image-captioning-base at the commit several public pipelines pin.
BLIP_BASE = "Salesforce/blip-image-captioning-base"
BLIP_BASE_REVISION = "82a37760796d32b1411fe092ab5d4e227313294b"
CLIPSEG = "CIDAS/clipseg-rd64-refined"
#: a snapshot commit of it that public code loads from (the hub itself is out of reach here: check it)
CLIPSEG_REVISION = "999e0328d9e10b484360c477313983f9afdd7050"


def is_hub_id(model: str) -> bool:
    """org/name that is not an existing local folder (a local path wins, as in tasks/base)."""
    return bool(HUB_ID.match(model)) and not Path(model).expanduser().exists()


class _ModelSection(StageConfig):
    model: str = Field(min_length=1, description="builtin:tiny-... | a local folder | a hub id (org/name)")
    revision: str | None = Field(
        None, description="the hub model's commit (40 hex digits); required for a hub id"
    )
    batch_size: int = Field(8, ge=1, le=256, description="images per model call")

    @model_validator(mode="after")
    def _pinned(self) -> _ModelSection:
        if is_hub_id(self.model) and (self.revision is None or not COMMIT.match(self.revision)):
            raise ValueError(
                f"revision: {self.model} is a hub id: pin `revision` to a commit (40 hex digits, "
                f"from the model page's 'Files and versions' history; got {self.revision!r}), "
                "or point `model` at a local folder"
            )
        return self


class CaptionerConfig(_ModelSection):
    """Captions made by an image-to-text model for images without one (or for all)."""

    model: str = Field(
        BLIP_BASE,
        min_length=1,
        description="an image-text-to-text model (BLIP, Florence-2, ...): builtin:tiny-blip | a "
        "local folder | a hub id (org/name)",
    )
    revision: str | None = Field(
        BLIP_BASE_REVISION, description="the hub model's commit (40 hex digits); required for a hub id"
    )
    mode: Literal["missing", "all"] = Field(
        "missing",
        description="missing: only images whose caption is the fallback (none was found); all: "
        "replace every caption",
    )
    prefix: str = Field("", description="put before each generated caption: the trigger word, e.g. 'sks toy, '")
    prompt: str | None = Field(
        None, description="text the model continues or answers (BLIP: e.g. 'a photography of'); null: none"
    )
    max_new_tokens: int = Field(30, ge=1, le=512, description="longest generated caption, in tokens")


class MaskerConfig(_ModelSection):
    """Subject masks made by a text-prompted segmentation model (CLIPSeg) for images without one."""

    model: str = Field(
        CLIPSEG, min_length=1, description="a CLIPSeg model: builtin:tiny-clipseg | a local folder | a hub id"
    )
    revision: str | None = Field(
        CLIPSEG_REVISION, description="the hub model's commit (40 hex digits); required for a hub id"
    )
    prompt: str = Field(min_length=1, description="what the subject is: the class word, e.g. 'toy'")
    prompts: dict[str, str] = Field(
        {}, description="per concept (the rows' `concept`, e.g. a kohya folder's name): what its subject is; "
                        "rows of other concepts use `prompt`")
    threshold: float | None = Field(
        0.4, gt=0.0, lt=1.0,
        description="pixels whose probability reaches it are subject (255), the rest 0; null: a soft "
        "mask (probability x 255)",
    )
