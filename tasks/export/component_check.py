"""One converted component against its PyTorch source, and its weights compressed as it is written.

The parity of a component (`export.components: one_at_a_time`): the inputs optimum-intel traced it
with (its export config's dummy inputs, drawn from a seeded generator) go through the PyTorch module
in the dtype it was loaded in (the source's stored dtype) and through the converted IR compiled in
f32; every output is compared. fp32 on the tiny models agrees to ~1e-6 relative; a wrong
weight gives a relative error of order 1. The error is taken relative to the largest magnitude
of the PyTorch output, so one threshold fits components whose outputs differ in scale.

Weight compression: NNCF's `compress_weights` on the IR just written (int8: every weight; int4:
`group_size`, `ratio`, a layer that `group_size` does not divide adjusted), the files replaced
before the next component loads.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from tasks.export.config import CompressionConfig

log = logging.getLogger(__name__)


def reference_inputs(export_config: Any, seed: int, input_shapes: dict[str, Any]) -> dict[str, Any]:
    """The component's example inputs (torch tensors, float32), the same on every run of `seed`."""
    import torch
    from optimum.exporters.openvino.utils import remove_none_from_dummy_inputs

    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        dummy = export_config.generate_dummy_inputs(framework="pt", **input_shapes)
    finally:
        torch.random.set_rng_state(state)
    dummy = export_config.rename_ambiguous_inputs(dummy)
    dummy, _ = remove_none_from_dummy_inputs(dummy)
    return dummy


def _flat(outputs: Any) -> list[Any]:
    """The tensors of a patched forward's outputs in the order the traced IR has them."""
    import torch

    if torch.is_tensor(outputs):
        return [outputs]
    if isinstance(outputs, dict) or hasattr(outputs, "values"):
        outputs = list(outputs.values())
    if isinstance(outputs, (list, tuple)):
        return [t for item in outputs for t in _flat(item)]
    return [] if outputs is None else [outputs]


def pytorch_output(module: Any, export_config: Any, inputs: dict[str, Any]) -> list[np.ndarray]:
    """The module's outputs on `inputs` (floating inputs cast to the module's dtype), through
    the same patched forward the conversion traced."""
    import torch
    from optimum.exporters.openvino.utils import _get_model_dtype, _normalize_dummy_inputs

    dtype = _get_model_dtype(module)
    if hasattr(module, "config"):  # as optimum-intel's export_pytorch sets them before tracing
        module.config.torchscript = False
        module.config.return_dict = True
        for key, value in (export_config.values_override or {}).items():
            setattr(module.config, key, value)
    module.eval()
    with torch.no_grad(), export_config.patch_model_for_export(module, model_kwargs={}):
        out = module(**_normalize_dummy_inputs(inputs, dtype))
    return [t.detach().float().cpu().numpy() for t in _flat(out)]


def openvino_output(xml: Path, inputs: dict[str, Any]) -> list[np.ndarray]:
    """The IR's outputs on `inputs`, compiled in f32 (floating inputs as float32, rounded like
    the PyTorch side's when that ran in 16 bit: see `rounded`)."""
    import openvino as ov

    compiled = ov.Core().compile_model(str(xml), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    feed = {}
    for port in compiled.inputs:
        name = next(n for n in port.get_names() if n in inputs)
        feed[name] = inputs[name].numpy()
    result = compiled(feed)
    out = [np.asarray(result[port], dtype=np.float32) for port in compiled.outputs]
    del compiled, result
    return out


def rounded(inputs: dict[str, Any], dtype: Any) -> dict[str, Any]:
    """`inputs` with floating tensors rounded to `dtype` and back to float32: what a 16-bit PyTorch
    module sees, given to the f32 IR too, so both start from the same numbers."""
    import torch

    return {k: v.to(dtype).float() if torch.is_tensor(v) and v.is_floating_point() else v
            for k, v in inputs.items()}


def compare(ref: list[np.ndarray], got: list[np.ndarray]) -> dict[str, Any]:
    """Over every output: max_abs, and max_rel (each output's max_abs over its reference's largest
    magnitude, the worst kept); None when an output is not finite or the shapes disagree."""
    shapes_ok = len(ref) == len(got) and all(r.shape == g.shape for r, g in zip(ref, got))
    if not shapes_ok:
        return {"max_abs": None, "max_rel": None, "finite": False, "outputs": len(got),
                "shape_mismatch": [[list(r.shape) for r in ref], [list(g.shape) for g in got]]}
    max_abs = max_rel = 0.0
    for r, g in zip(ref, got):
        diff = float(np.abs(r.astype(np.float64) - g.astype(np.float64)).max())
        if not np.isfinite(diff):
            return {"max_abs": None, "max_rel": None, "finite": False, "outputs": len(got)}
        max_abs = max(max_abs, diff)
        max_rel = max(max_rel, diff / (float(np.abs(r).max()) or 1.0))
    return {"max_abs": max_abs, "max_rel": max_rel, "finite": True, "outputs": len(got)}


def nncf_mode(cfg: CompressionConfig) -> dict[str, Any]:
    """compress_weights' arguments for `cfg.mode` (int8, int4), as optimum-intel's
    `--weight-format int8 / int4` would pass them."""
    import nncf

    modes = nncf.CompressWeightsMode
    if cfg.mode == "int8":
        return {"mode": modes.INT8_SYM if cfg.sym else modes.INT8_ASYM}
    if cfg.mode == "int4":
        # A layer whose input channels `group_size` does not divide gets the largest power of two
        # that does (>= 16), or stays in the 8-bit backup: NNCF's default stops the whole export.
        advanced = nncf.AdvancedCompressionParameters(group_size_fallback_mode=nncf.GroupSizeFallbackMode.ADJUST)
        return {"mode": modes.INT4_SYM if cfg.sym else modes.INT4_ASYM, "group_size": cfg.group_size,
                "ratio": cfg.ratio, "advanced_parameters": advanced}
    raise ValueError(f"export.compression.mode {cfg.mode!r} is not weight-only compression")


def compress_ir(xml: Path, cfg: CompressionConfig) -> dict[str, float]:
    """Replace the IR at `xml` by its weight-compressed version; returns its MB before and after."""
    import nncf
    import openvino as ov

    before = (xml.with_suffix(".bin").stat().st_size) / 1024 ** 2
    model = nncf.compress_weights(ov.Core().read_model(xml), **nncf_mode(cfg))
    tmp = xml.with_name(xml.stem + ".compressed.xml")
    ov.save_model(model, tmp, compress_to_fp16=False)
    del model
    os.replace(tmp.with_suffix(".bin"), xml.with_suffix(".bin"))
    os.replace(tmp, xml)
    after = (xml.with_suffix(".bin").stat().st_size) / 1024 ** 2
    log.info("%s: weights compressed (%s) from %.1f MB to %.1f MB", xml.parent.name, cfg.mode, before, after)
    return {"bin_mb_before": round(before, 3), "bin_mb_after": round(after, 3)}
