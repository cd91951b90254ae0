"""Captions made at ingest by an image-to-text model (`ingest.captioner`).

Any model transformers' `AutoModelForImageTextToText` loads (BLIP, Florence-2, GIT, SmolVLM, ...)
with its `AutoProcessor`, run with `generate` in batches. The generated text goes through the
same policy as a file's caption (`captions.max_words` / `too_long`), after the `prefix` (the
trigger word) is put before it. A caption the policy would drop, or an empty one, never drops the
image: the row keeps the caption it had (the fallback), and the report counts it.
"""
from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Any

from PIL import Image

from tasks.ingest import captions
from tasks.ingest.annotate_config import CaptionerConfig
from tasks.ingest.checks import Reject
from tasks.ingest.config import Captions

log = logging.getLogger(__name__)


class Captioner:
    name = "captioner"

    def __init__(self, cfg: CaptionerConfig, policy: Captions, folder: Path, identity: str) -> None:
        from transformers import AutoModelForImageTextToText

        from tasks.ingest.model_load import load_model

        self.processor, self.model = load_model(AutoModelForImageTextToText, folder, "ingest.captioner.model",
                                                cfg.model, "an image-text-to-text model")
        self.cfg, self.policy, self.identity = cfg, policy, identity
        self.batch_size = cfg.batch_size
        self.outcomes: Counter = Counter(captioned=0, empty=0, policy_refused=0)
        self.replaced: Counter = Counter()  # caption_source the generated caption replaced
        log.info("captioner: %s (%s)", cfg.model, type(self.model).__name__)

    def wants(self, row: dict[str, Any]) -> bool:
        """mode missing: rows with no caption of their own (the fallback, or a kohya folder's name)."""
        return self.cfg.mode == "all" or row.get("caption_source") in ("fallback", "folder_name")

    def prefix(self, row: dict[str, Any]) -> str:
        """`prefix`; where it is empty, a kohya folder's name (its trigger and class) leads the caption."""
        if self.cfg.prefix or row.get("caption_source") != "folder_name":
            return self.cfg.prefix
        return f"{row['text']}, "

    def _inputs(self, images: list[Image.Image]) -> Any:
        prompt = self.cfg.prompt
        if getattr(self.processor, "chat_template", None):  # chat VLMs: the image and a question
            content = [{"type": "image"}, {"type": "text", "text": prompt or "Describe this image briefly."}]
            text = self.processor.apply_chat_template(
                [{"role": "user", "content": content}], add_generation_prompt=True
            )
            return self.processor(images=[[im] for im in images], text=[text] * len(images),
                                  return_tensors="pt")
        if prompt:
            return self.processor(images=images, text=[prompt] * len(images), return_tensors="pt")
        return self.processor(images=images, return_tensors="pt")

    def settings(self, row: dict[str, Any]) -> dict[str, Any]:
        return {"prompt": self.cfg.prompt, "max_new_tokens": self.cfg.max_new_tokens}

    def compute(self, images: list[Image.Image], rows: list[dict[str, Any]]) -> list[bytes]:
        """The raw generated text per image (UTF-8): what the cache keeps."""
        import torch

        inputs = self._inputs(images)
        with torch.inference_mode():
            ids = self.model.generate(**inputs, max_new_tokens=self.cfg.max_new_tokens, do_sample=False)
        given = inputs.get("input_ids")
        if given is not None and ids.shape[1] > given.shape[1] and torch.equal(ids[:, : given.shape[1]], given):
            ids = ids[:, given.shape[1] :]  # decoder-only models echo their input first
        texts = self.processor.batch_decode(ids, skip_special_tokens=True)
        return [" ".join(t.split()).encode() for t in texts]

    def apply(self, row: dict[str, Any], result: bytes, out_dir: Path) -> None:
        text = result.decode()
        if not text:
            self.outcomes["empty"] += 1
            return
        try:
            caption = captions.decide(self.prefix(row) + text, "captioner", None, None, self.policy)
        except Reject:
            caption = None
        if caption is None or caption.source != "captioner":  # too long, and the policy drops it
            self.outcomes["policy_refused"] += 1
            return
        self.replaced[row.get("caption_source")] += 1
        self.outcomes["captioned"] += 1
        row.update(text=caption.text, tags=[], caption_source="captioner",
                   caption_truncated=caption.truncated)
