"""A family's input images: the images its pipeline takes beside the prompt (the `image` argument),
one of the roles a family is built from.

How many one call may take and how many it needs, whether training pairs each target with them (an
edit dataset's reference images: ingest's `reference_file_names`, then the caches, the loss and the
denoiser's call), and how the pipeline prepares one before its VAE, which training copies for a
reference. Training's checks, validation, evaluate's edit set, the flow's combination check and the
call convention recorded with a registered model (`input_images`, `min_input_images`) read it as one
object (`ModelFamily.inputs`).

A family whose pipeline prepares an input image in its own way subclasses it in its module
(Qwen-Image-Edit scales it to a megapixel).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class InputImages:
    """The input images of one family (the default: prompts only)."""

    #: how many input images one call may take (0: prompts only)
    most: int = 0
    #: how many one call needs (Qwen-Image-Edit makes no image from a prompt alone)
    least: int = 0
    #: training pairs each target with its reference images (an edit dataset); a family without refuses
    #: a dataset that has them. LTX-Video takes a first frame (`most` 1) but trains it from the clip itself
    trains: bool = False
    #: the family's title, for messages (ModelFamily sets it)
    title: str = "this model family"

    def pixels(self, pixels: Any) -> Any:
        """A training reference (1, 3, H, W) in [-1, 1] as the pipeline encodes an input image of it
        (here: as it is)."""
        return pixels
