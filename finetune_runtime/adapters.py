"""Trained adapters applied to a loaded pipeline: diffusers' LoRA file and peft's folders.

LoRA and DoRA are read by the pipeline's own `load_lora_weights`; LoKr and LoHa, which diffusers
has no loader for, by peft's (`PeftModel.from_pretrained`, one folder per adapted component; the
train stage writes them, tasks/common/adapters.py). The stages and the served model apply a train
output's adapters through `apply`.
"""
from __future__ import annotations

import logging
import os
import warnings
from typing import Any

from finetune_runtime.layout import Contents, peft_components

log = logging.getLogger(__name__)


def apply_peft(pipe: Any, folder: str | os.PathLike, merge: bool = True) -> list[str]:
    """Apply the peft adapters of `folder` (one folder per component) to the pipeline's components;
    returns the components. `merge`: fused into the weights (`merge_and_unload`); otherwise peft's
    adapter layers stay in the components, unfused (over a quantized base). An adapter file whose
    tensors do not all load is refused, not half-applied."""
    from peft import PeftModel

    names = peft_components(folder)
    for name in names:
        module, path = getattr(pipe, name, None), os.path.join(folder, name)
        if module is None:
            raise ValueError(f"{path} holds adapters for {name!r}, which the pipeline does not have")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = PeftModel.from_pretrained(module, path)
        if missing := [w for w in caught if "missing adapter keys" in str(w.message)]:
            raise ValueError(f"{path}: its adapter tensors do not match the {name} layers "
                             f"({str(missing[0].message)[:200]})")
        setattr(pipe, name, model.merge_and_unload() if merge else model.get_base_model())
    log.info("%s peft adapters (%s) from %s", "fused" if merge else "applied", ", ".join(names), folder)
    return names


def apply(pipe: Any, contents: Contents, merge_peft: bool) -> None:
    """The adapters `contents` holds onto `pipe`: diffusers' LoRA file as the pipeline's LoRA layers,
    unfused; peft's folders fused (`merge_peft`) or as peft's layers."""
    if contents.lora is None:
        return
    if contents.lora.is_dir():
        apply_peft(pipe, contents.lora, merge=merge_peft)
    else:
        pipe.load_lora_weights(contents.lora.parent, weight_name=contents.lora.name)
