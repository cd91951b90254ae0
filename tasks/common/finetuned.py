"""What the train stage left, loaded as one PyTorch pipeline: a full pipeline or base + adapters.

Every training method's output is accepted, detected from the folder's contents:

- a full pipeline (`model_index.json`: DreamBooth, full fine-tunes, textual inversion, LoRA saved
  with `fuse_lora`): loaded as it is;
- adapters only (`pytorch_lora_weights.safetensors`, LoKr/LoHa in `peft_adapters/`, and/or
  `learned_embeds.safetensors`, no `model_index.json`): the base pipeline is loaded, the adapters
  fused into its weights and the new tokens added to its tokenizers.

Used by the export stage (which saves the result and converts it) and by the evaluate stage
(which generates with it in PyTorch fp32, or on a quantized denoiser with the adapters unfused,
beside the base, for like-with-like gains).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from finetune_runtime import adapters, layout
from finetune_runtime.layout import EMBEDS as EMBEDS_NAME
from finetune_runtime.layout import LORA_WEIGHTS as LORA_NAME
from finetune_runtime.layout import PEFT_DIR, Contents
from tasks.common import families
from tasks.common.errors import UserError
from tasks.common.lora import fuse_lora_file
from tasks.common.quantized_pipeline import load_with_denoiser_last

log = logging.getLogger(__name__)


def detect(src: Path) -> Contents:
    """What `src` holds (finetune_runtime/layout.py); a UserError names what was expected when it
    holds nothing loadable."""
    src = Path(src)
    if not src.is_dir():
        raise UserError(
            f"{src} does not exist: run the train stage first (dvc repro train) or pass a "
            "diffusers pipeline folder"
        )
    kind = layout.contents(src)
    if kind.empty:
        raise UserError(
            f"{src} holds neither a pipeline (model_index.json) nor adapters ({LORA_NAME}, {PEFT_DIR}/, "
            f"{EMBEDS_NAME}): pass the train stage's output folder"
        )
    return kind


def per_encoder_family(state: dict[str, Any]) -> type[families.ModelFamily] | None:
    """The family whose embedding files key rows per text encoder (`embedding_keys`) as `state` does;
    None for the one-entry {token: rows} layout."""
    return next((f for f in families.FAMILIES if f.text.embedding_keys and set(f.text.embedding_keys) <= set(state)),
                None)


def load_embeds(pipe: Any, path: Path, token: str | None) -> list[str]:
    """Add the learned token(s) of `path` to the pipeline's tokenizer(s); returns the tokens."""
    from safetensors.torch import load_file

    state = load_file(path)
    if (keyed := per_encoder_family(state)) is not None:
        keys = keyed.text.embedding_keys or ()
        if not token:
            raise UserError(
                f"{path} is a {keyed.title} embedding (keys {'/'.join(keys)}) and does not carry its token: "
                "set export.placeholder_token (the train stage's train.placeholder_token)"
            )
        family = families.of_pipeline(pipe)
        if family.text.embedding_keys != keyed.text.embedding_keys:
            raise UserError(f"{path} is a {keyed.title} embedding but the base pipeline is {family.title}")
        for key, encoder, tokenizer in zip(keys, family.text.encoder_names, family.text.tokenizer_names):
            pipe.load_textual_inversion(state[key], token=token, text_encoder=getattr(pipe, encoder),
                                        tokenizer=getattr(pipe, tokenizer))
        return [token]
    if len(state) != 1:
        layouts = " or ".join(f"{'/'.join(f.text.embedding_keys)} ({f.title})" for f in families.FAMILIES
                              if f.text.embedding_keys)
        raise UserError(
            f"{path}: expected one {{token: embedding}} entry or {layouts}, found keys {sorted(state)}"
        )
    name, rows = next(iter(state.items()))
    name = token or name
    # diffusers' loader names the extra rows of a multi-vector token <token>_1 ... itself.
    pipe.load_textual_inversion({name: rows}, token=name)
    return [name]


def load_finetuned(src: Path, base: Path | None, token: str | None = None, quantize: Any = None,
                   dtype: Any = None) -> tuple[Any, Contents, dict[str, Any]]:
    """The fine-tuned pipeline: `src` itself, or the base with `src`'s adapters applied.

    In fp32 with the adapters fused, by default. With `quantize` (a BasePrecision): the denoiser's
    Linear layers quantized as they load, the rest in `dtype` (tasks/common/quantized_pipeline.py), and
    the adapters left unfused, peft's layers over the quantized ones (a quantized weight cannot take a
    fused delta), as the train stage's validation images are made.
    Returns (pipeline, what `src` held, report section {method, base, lora, embeds, tokens}).
    """
    kind = detect(src)
    info: dict[str, Any] = {"method": kind.method}
    if kind.full_pipeline:
        return load_pipeline(src, quantize, dtype), kind, info
    adapters_only = (f"{src} holds adapters only ({kind.method}); they are applied to the base pipeline: "
                     "pass --base models/base (run dvc repro base first)")
    if base is None:
        raise UserError(adapters_only)
    families.read_index(base, adapters_only)
    pipe = load_pipeline(base, quantize, dtype)
    info["base"] = str(base)
    if kind.lora is not None:
        _apply_lora(pipe, kind, fuse=quantize is None)
        info["lora"] = str(kind.lora)
    if kind.embeds is not None:
        info["tokens"] = load_embeds(pipe, kind.embeds, token)
        info["embeds"] = str(kind.embeds)
    log.info("applied %s from %s to %s", kind.method, src, base)
    return pipe, kind, info


def load_pipeline(folder: Path, quantize: Any = None, dtype: Any = None) -> Any:
    """The pipeline of `folder` in fp32, or with its denoiser quantized as it loads (the rest in `dtype`)."""
    import torch
    from diffusers import DiffusionPipeline

    if quantize is None:
        return DiffusionPipeline.from_pretrained(folder, dtype=torch.float32)
    return load_with_denoiser_last(folder, dtype or torch.float32, "cpu", quantize)


def _apply_lora(pipe: Any, kind: Contents, fuse: bool) -> None:
    """The adapters of `kind` (diffusers' file, or peft's folders) into every component they have layers
    for: fused, the adapter modules dropped (plain tensors with the LoRA inside), or as peft's or
    diffusers' layers (unfused), as the served model applies them (finetune_runtime/adapters.py)."""
    if fuse and kind.lora is not None and kind.lora.is_file():
        fuse_lora_file(pipe, kind.lora)
    else:
        adapters.apply(pipe, kind, merge_peft=fuse)
