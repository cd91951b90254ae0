"""Adapter output formats (`train.lora_format`), declared without torch: the registry every check asks.

Each format is an `AdapterFormat`: its name (params.yaml's value), the file it writes beside the
method's own adapter files (None: it adds none), the function that writes it, and which families
it can be written for, so a format a family's readers cannot load is refused up front, naming
the formats that work:

    fmt = adapter_format(cfg.lora_format)          # a ValueError naming the known formats
    format_refusal(cfg.lora_format, family)         # None, or one line: key, family, the formats that work
    fmt.file, fmt.writer(path, family, modules, lora_type, rank, alpha)

- `diffusers`: the adapter files every method writes anyway (diffusers' LoRA file for LoRA and
  DoRA, peft's folders for LoKr and LoHa; tasks/common/adapters.py); every family.
- `comfyui` (SimpleTuner's name): also one file under ComfyUI's LoRA keys (tasks/common/comfyui_lora.py),
  for a family that has ComfyUI key prefixes (`ModelFamily.export.comfyui_lora_prefixes` is not None:
  Sana's is None, ComfyUI has no Sana model to map the keys to).

A new format is one `AdapterFormat` added with `register` (the train config then accepts its name);
`FORMATS` is the registry (finetune_runtime/registry.py, the one style of every name-chosen record).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from finetune_runtime.registry import Registry
from tasks.common import comfyui_lora  # torch-free until it writes


@dataclass(frozen=True)
class AdapterFormat:
    name: str
    #: what it writes (the parameter reference shows it beside the name)
    description: str
    #: the file it adds beside the method's own adapter files; None: it adds none
    file: str | None = None
    #: the function writing `file` (torch imported inside it): (path, family, modules, lora_type, rank,
    #: alpha) -> the number of layers written
    writer: Callable[..., int] | None = None
    #: whether the file can be written for (and loaded by its reader for) a family (a ModelFamily)
    supports: Callable[[Any], bool] = lambda family: True
    #: why a family it does not support cannot have it ({title}: the family's), for the refusal
    unsupported: str = ""


DIFFUSERS = AdapterFormat(
    name="diffusers",
    description="the adapter files above only")

COMFYUI = AdapterFormat(
    name="comfyui",
    description="also one file with ComfyUI's keys, comfyui_lora.safetensors (SimpleTuner's name; refused for a "
                "family ComfyUI has no model for; tasks/train/README.md)",
    file=comfyui_lora.COMFYUI_LORA_NAME,
    writer=comfyui_lora.write_comfyui_lora,
    supports=lambda family: family.export.comfyui_lora_prefixes is not None,
    unsupported="ComfyUI has no {title} model, so its LoRA loader would map none of the file's keys")

#: every format, in the order the parameter reference lists them
FORMATS: Registry[AdapterFormat] = Registry("adapter format", (DIFFUSERS, COMFYUI))


def register(fmt: AdapterFormat) -> None:
    """Add (or replace) a format; train.lora_format then accepts its name."""
    FORMATS.register(fmt)


def unregister(name: str) -> None:
    FORMATS.unregister(name)


def names() -> tuple[str, ...]:
    return FORMATS.names()


def adapter_format(name: str) -> AdapterFormat:
    """The format called `name`, or a ValueError naming the known ones."""
    return FORMATS.get(name)


def names_for(family: Any) -> list[str]:
    """The formats `family` (a ModelFamily) can have its adapters written in."""
    return [f.name for f in FORMATS.where(lambda f: f.supports(family))]


def format_refusal(name: str, family: Any) -> str | None:
    """Why `family` cannot have its adapters written as `name`, in one line, or None."""
    fmt = adapter_format(name)
    if fmt.supports(family):
        return None
    why = fmt.unsupported.format(title=family.title) or f"{fmt.name} cannot be written for {family.title}"
    return (f"train.lora_format: {fmt.name} is not available for {family.title} ({why}); "
            f"choose one of {', '.join(names_for(family))}")


def describe() -> str:
    """Every format with what it writes, for the config's field description."""
    return " | ".join(f"{f.name}: {f.description}" for f in FORMATS)
