"""Training data: imagefolders (metadata.jsonl with file_name/text) into paired DreamBooth examples.

An example holds one instance image and, with prior preservation, one class image; a batch puts
all instance images first and all class images after, so the loss can split the prediction in
two halves (as diffusers' DreamBooth example does). The length is max(instances, class images):
every class image is seen once per epoch while the few instance images repeat.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from tasks.common.errors import UserError
from tasks.common.images import apply_exif_orientation, to_rgb

log = logging.getLogger(__name__)

METADATA = "metadata.jsonl"


@dataclass(frozen=True)
class Record:
    path: Path
    text: str


def read_imagefolder(folder: Path, what: str, fix: str) -> list[Record]:
    """The rows of `folder/metadata.jsonl` whose image exists; a UserError (with `fix`) if none.

    `what` names the folder in messages ("instance images", "class images").
    """
    folder = Path(folder)
    meta = folder / METADATA
    if not meta.is_file():
        raise UserError(f"{what}: {meta} not found. {fix}")
    records: list[Record] = []
    with open(meta, encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                path = folder / row["file_name"]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise UserError(f"{what}: {meta}:{line_no} is not a JSON object with a file_name ({err}). {fix}") from None
            if not path.is_file():
                raise UserError(f"{what}: {meta}:{line_no} lists {row['file_name']}, which is missing. {fix}")
            records.append(Record(path, str(row.get("text") or "")))
    if not records:
        raise UserError(f"{what}: {folder} holds no images. {fix}")
    return records


def prepare_image(
    image: Image.Image, resolution: int, center_crop: bool, flip: bool
) -> tuple[torch.Tensor, tuple[int, int], tuple[int, int]]:
    """Resize (short side), crop square, optionally flip; -> (CHW tensor in [-1, 1], original (h, w), crop (top, left)).

    The original size and crop corner are what SDXL's micro-conditioning takes. A random crop
    draws from torch's RNG, which the run seeds (and which accelerate checkpoints with the state).
    """
    image = to_rgb(apply_exif_orientation(image))
    original = (image.height, image.width)
    scale = resolution / min(image.size)
    size = (max(resolution, round(image.width * scale)), max(resolution, round(image.height * scale)))
    if size != image.size:
        image = image.resize(size, Image.Resampling.BILINEAR)
    if center_crop:
        top, left = (image.height - resolution) // 2, (image.width - resolution) // 2
    else:
        top = int(torch.randint(0, image.height - resolution + 1, ()))
        left = int(torch.randint(0, image.width - resolution + 1, ()))
    image = image.crop((left, top, left + resolution, top + resolution))
    if flip:
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    array = np.asarray(image, dtype=np.float32) / 127.5 - 1.0
    return torch.from_numpy(array).permute(2, 0, 1).contiguous(), original, (top, left)


class DreamBoothDataset(Dataset):
    """Instance images with the instance prompt, paired with class images and the class prompt."""

    def __init__(
        self,
        instances: list[Record],
        classes: list[Record] | None,
        instance_prompt: str,
        class_prompt: str,
        resolution: int,
        center_crop: bool = True,
        random_flip: bool = False,
    ) -> None:
        self.instances, self.classes = instances, classes or []
        self.instance_prompt, self.class_prompt = instance_prompt, class_prompt
        self.resolution, self.center_crop, self.random_flip = resolution, center_crop, random_flip

    def __len__(self) -> int:
        return max(len(self.instances), len(self.classes))

    def _load(self, record: Record) -> dict[str, Any]:
        with Image.open(record.path) as im:
            flip = self.random_flip and bool(torch.rand(()) < 0.5)
            pixels, original, crop = prepare_image(im, self.resolution, self.center_crop, flip)
        return {"pixels": pixels, "original_size": original, "crop_top_left": crop}

    def __getitem__(self, index: int) -> dict[str, Any]:
        example = {"instance": self._load(self.instances[index % len(self.instances)]),
                   "instance_prompt": self.instance_prompt}
        if self.classes:
            example["class"] = self._load(self.classes[index % len(self.classes)])
            example["class_prompt"] = self.class_prompt
        return example


def collate(examples: list[dict[str, Any]]) -> dict[str, Any]:
    """Stack a batch: instance images first, then class images (when present)."""
    parts = [e["instance"] for e in examples]
    prompts = [e["instance_prompt"] for e in examples]
    if "class" in examples[0]:
        parts += [e["class"] for e in examples]
        prompts += [e["class_prompt"] for e in examples]
    return {
        "pixels": torch.stack([p["pixels"] for p in parts]),
        "prompts": prompts,
        "original_sizes": torch.tensor([p["original_size"] for p in parts], dtype=torch.long),
        "crops_top_left": torch.tensor([p["crop_top_left"] for p in parts], dtype=torch.long),
        "num_instances": len(examples),
    }
