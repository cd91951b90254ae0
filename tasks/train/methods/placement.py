"""Where a module runs during training, and in which precision (shared by placing and caching)."""
from __future__ import annotations

import torch

from tasks.common.quantize import has_quantized, place_quantized


def put(module: torch.nn.Module, name: str, device: torch.device, dtype: torch.dtype, trainable: bool) -> None:
    """One module where training runs it: frozen ones in the low precision (they only run forward),
    trained ones in float32."""
    # fp16 VAEs overflow (SDXL's notably); bf16 has fp32's range.
    target = torch.float32 if trainable or (name == "vae" and dtype == torch.float16) else dtype
    if has_quantized(module):
        place_quantized(module, device, target)  # a quantized base: its 8/4-bit weights keep their format
    elif target == torch.float32:
        module.to(device)  # already fp32 (passing a dtype makes diffusers warn for nothing)
    else:
        module.to(device, dtype=target)
