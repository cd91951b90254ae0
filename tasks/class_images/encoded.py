"""Class images with the text encoders gone before the denoiser loads: one of them in memory at a time.

A base's text encoders can weigh as much as its denoiser (FLUX.1's T5-XXL 9.5 GB, FLUX.2 [klein]'s
Qwen3 8 GB, Qwen-Image's Qwen2.5-VL 16 GB). Every class image of a run has the same prompt (and
negative prompt), so the text is encoded once per batch size, the encoders released, and only then
the denoiser loaded: the train stage's text cache, here for the pipeline's own call.

It works for every family without knowing how each pipeline encodes: each text encoder's outputs
are recorded while the pipeline runs its call up to where it first needs the denoiser (a
placeholder there stops it), and the encoder is then replaced by a `Replay` that answers the same
inputs with the recorded outputs. The second call runs the pipeline's own code throughout, so the
images are bit for bit those the whole pipeline makes (tests/class_images/test_encoded.py, every
family); an input never recorded is an error, never a silent re-encode.
"""
from __future__ import annotations

import gc
import hashlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tasks.common import families

log = logging.getLogger(__name__)


class _Stop(Exception):
    """Raised by the denoiser's placeholder: the pipeline has encoded its prompts."""


class _NotLoadedYet:
    """Stands where the denoiser goes until the text is encoded: its config answers (pipelines read
    it to decide on guidance before they encode), any other use stops the call."""

    def __init__(self, config: Any) -> None:
        self.config = config

    def __getattr__(self, name: str) -> Any:
        raise _Stop(name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise _Stop("forward")


def _key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """A text encoder call's inputs as a key: every tensor's dtype, shape and bytes, other values' repr."""
    digest = hashlib.sha256()
    for name, value in [*enumerate(args), *sorted(kwargs.items())]:
        digest.update(str(name).encode())
        if isinstance(value, torch.Tensor):
            digest.update(f"{value.dtype}{tuple(value.shape)}".encode())
            digest.update(value.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        else:
            digest.update(repr(value).encode())
    return digest.hexdigest()


class Replay(torch.nn.Module):
    """A released text encoder: the outputs recorded for its inputs, with its config, dtype and device."""

    def __init__(self, name: str, encoder: torch.nn.Module, outputs: dict[str, Any]) -> None:
        super().__init__()
        self.name, self.outputs, self.config = name, outputs, encoder.config
        self._dtype, self._device = encoder.dtype, encoder.device

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self._device

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        key = _key(args, kwargs)
        if key not in self.outputs:
            raise RuntimeError(f"{self.name} was released after encoding the class prompt, and is now asked to "
                               "encode other inputs: encode every call's text before releasing it")
        return self.outputs[key]


def record(pipe: Any, calls: Sequence[Callable[[Any], Any]], denoiser_config: Any) -> dict[str, Replay]:
    """Run each of `calls` (a pipeline call, given the pipeline) up to the denoiser, recording what
    every text encoder returned; the encoders' Replays (a pipeline with no denoiser loaded: a
    placeholder with its config stops each call there)."""
    family = families.of_pipeline(pipe)
    outputs: dict[str, dict[str, Any]] = {}
    hooks = []
    for name in family.text.encoder_names:
        encoder = getattr(pipe, name, None)
        if isinstance(encoder, torch.nn.Module):
            store = outputs.setdefault(name, {})
            hooks.append(encoder.register_forward_hook(
                lambda _m, args, kwargs, out, store=store: store.__setitem__(_key(args, kwargs), out),
                with_kwargs=True))
    object.__setattr__(pipe, family.denoiser.name, _NotLoadedYet(denoiser_config))
    try:
        for call in calls:
            try:
                call(pipe)
            except _Stop:
                pass
            else:
                raise RuntimeError("the pipeline call ran to the end without its denoiser")
    finally:
        for hook in hooks:
            hook.remove()
    return {name: Replay(name, getattr(pipe, name), store) for name, store in outputs.items()}


def release_text_encoders(pipe: Any, replays: dict[str, Replay]) -> None:
    """Put each text encoder's Replay in its place; the encoders' weights are freed."""
    for name, replay in replays.items():
        setattr(pipe, name, replay)
    gc.collect()
    log.info("class images: the prompts encoded, %s released before the denoiser loads", ", ".join(replays))
