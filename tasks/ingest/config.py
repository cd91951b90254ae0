"""The `ingest` section of params.yaml."""
from __future__ import annotations

from pathlib import Path

from pydantic import Field

from tasks.common.config import StageConfig


class IngestConfig(StageConfig):
    """`ingest` section of params.yaml: where the instance images are and what is kept."""

    source: Path = Field(
        Path("data/demo/subject"),
        description="folder of images with same-named .txt captions (any depth)",
    )
    resolution: int = Field(
        64, gt=0, le=8192, description="short side is resized to this, then cropped square"
    )
    center_crop: bool = Field(True, description="crop the square from the centre; false: top-left")
    min_side: int = Field(32, ge=1, description="images whose short side is smaller are rejected")
    max_pixels: int = Field(
        89_478_485, gt=0, description="images with more pixels are rejected (decompression bombs)"
    )
    max_aspect_ratio: float = Field(
        4.0, ge=1.0, description="long side / short side above this is rejected"
    )
    caption_fallback: str = Field(
        "a photo of sks toy", min_length=1, description="caption for images without a caption file"
    )
