"""Subject masks made at ingest by CLIPSeg with a text prompt (`ingest.masker`).

CLIPSeg (`CLIPSegForImageSegmentation` + `CLIPSegProcessor`) scores each pixel of a 352 px view
of the image against the prompt (the class word). The probabilities are resized to the
processed image's size and cached as a soft 8-bit mask; `threshold` then makes it 0/255 (or
null keeps it soft). Masks go to `masks/<stem of file_name>.png` (8-bit L, 255 = subject), and
the row gets `mask_file_name` and `mask_source: generated`. Rows that already have a mask are
left alone; a mask with no subject pixel at all is not written (the image trains unmasked).
"""
from __future__ import annotations

import io
import logging
from collections import Counter
from pathlib import Path
from typing import Any

from PIL import Image

from tasks.ingest.annotate_config import MaskerConfig

log = logging.getLogger(__name__)

MASKS = "masks"


class Masker:
    name = "masker"

    def __init__(self, cfg: MaskerConfig, folder: Path, identity: str) -> None:
        from transformers import CLIPSegForImageSegmentation

        from tasks.ingest.model_load import load_model

        self.processor, self.model = load_model(CLIPSegForImageSegmentation, folder, "ingest.masker.model",
                                                cfg.model, "a CLIPSeg model")
        self.cfg, self.identity, self.batch_size = cfg, identity, cfg.batch_size
        self.outcomes: Counter = Counter(generated=0, empty=0)
        log.info("masker: %s, prompt %r", cfg.model, cfg.prompt)

    def wants(self, row: dict[str, Any]) -> bool:
        return not row.get("mask_file_name")

    def prompt(self, row: dict[str, Any]) -> str:
        """What the row's subject is: its concept's entry of `prompts`, else `prompt`."""
        return self.cfg.prompts.get(row.get("concept") or "", self.cfg.prompt)

    def settings(self, row: dict[str, Any]) -> dict[str, Any]:
        return {"prompt": self.prompt(row)}  # the threshold is applied after the cache

    def compute(self, images: list[Image.Image], rows: list[dict[str, Any]]) -> list[bytes]:
        """A soft mask per image (PNG, L, the image's size): probability x 255."""
        import torch
        import torch.nn.functional as F

        inputs = self.processor(
            text=[self.prompt(r) for r in rows], images=images, padding=True, return_tensors="pt"
        )
        with torch.inference_mode():
            logits = self.model(**inputs).logits
        probs = torch.sigmoid(logits.reshape(len(images), 1, *logits.shape[-2:]))
        out = []
        for p, im in zip(probs, images):
            p = F.interpolate(p[None], size=(im.height, im.width), mode="bilinear", align_corners=False)
            pixels = (p[0, 0] * 255).round().clamp(0, 255).to(torch.uint8).numpy()
            buf = io.BytesIO()
            Image.fromarray(pixels, "L").save(buf, format="PNG")
            out.append(buf.getvalue())
        return out

    def apply(self, row: dict[str, Any], result: bytes, out_dir: Path) -> None:
        with Image.open(io.BytesIO(result)) as soft:
            mask = soft.convert("L")
        if self.cfg.threshold is not None:
            level = self.cfg.threshold * 255
            mask = mask.point(lambda v: 255 if v >= level else 0)
        if mask.getextrema()[1] == 0:
            self.outcomes["empty"] += 1
            return
        name = f"{MASKS}/{Path(row['file_name']).stem}.png"
        (out_dir / MASKS).mkdir(exist_ok=True)
        mask.save(out_dir / name, format="PNG")
        row.update(mask_file_name=name, mask_source="generated")
        self.outcomes["generated"] += 1
