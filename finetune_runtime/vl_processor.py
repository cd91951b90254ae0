"""Qwen2.5-VL's processor for images and text only, so that Qwen-Image-Edit loads without torchvision.

transformers' Qwen2VLProcessor (5.15.1) holds a video processor too, which needs torchvision, and
this stack cannot install torchvision (PyPI has none for torch 2.15; docs/development.md, "Dependencies"). The
class here is Qwen2VLProcessor with its image processor and tokenizer only: the same text expansion
of each `<|image_pad|>` into the image's vision tokens and the same image preprocessing (the PIL
image processor transformers falls back to), no video. A pipeline saved with it records this module
in its model_index.json (`processor`), so diffusers imports it on every load, the served model's
included (this package is the registered version's code).
"""
from __future__ import annotations

from typing import Any

from transformers import Qwen2VLProcessor
from transformers.processing_utils import ProcessorMixin


class ImageQwen2VLProcessor(Qwen2VLProcessor):
    """Qwen2VLProcessor without its video processor (videos are refused by the parent's call)."""

    def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None,
                 **kwargs: Any) -> None:
        self.image_token = getattr(tokenizer, "image_token", "<|image_pad|>")
        self.video_token = getattr(tokenizer, "video_token", "<|video_pad|>")
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = None
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)
