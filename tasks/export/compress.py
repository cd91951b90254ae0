"""Weight compression (8-bit, 4-bit) and 8-bit quantization of the exported pipeline with NNCF.

Done through optimum-intel's own `quantization_config`, applied when the fp32 IR is loaded, so the
files written are what `optimum-cli export openvino` itself would produce (the flags below):

- `int8`: every weight to 8 bit (asymmetric by default); ~4x smaller, PSNR vs fp32 typically
  high (`--weight-format int8`).
- `int4`: weights to 4 bit in groups of `group_size` (`ratio` of the layers; the rest stay 8 bit;
  `--weight-format int4`).
- `hybrid`: the UNet's convolutions quantized in full (weights and activations 8 bit, calibrated
  by running the pipeline on `calibration_prompts`), its MatMul weights to 8 bit only; other
  components get weights-only 8 bit (`--weight-format int8 --dataset ...`).
- `full_int8`: every UNet layer quantized in full, MatMuls too; other components weights-only
  8 bit (`--quant-mode int8 --dataset ...`). The fastest on CPUs with VNNI or AMX (8-bit dot
  products); the most lossy.

The fp32 export stays the reference: parity (is the conversion right?) is checked on it, and the
compressed pipeline is compared with it on the same latents (`psnr_vs_openvino_fp32_db`).
"""
from __future__ import annotations

import gc
import logging
import os
import time
from pathlib import Path
from typing import Any

from tasks.common import families
from tasks.common.memory import release_memory
from tasks.common.openvino_model import StaticShape
from tasks.export.config import CompressionConfig

log = logging.getLogger(__name__)


def quantization_config(cfg: CompressionConfig) -> Any:
    """optimum-intel's quantization config for `cfg.mode` (None for 'none')."""
    from optimum.intel import OVQuantizationConfig, OVWeightQuantizationConfig

    if cfg.mode == "none":
        return None
    if cfg.mode == "int8":
        return OVWeightQuantizationConfig(bits=8, sym=cfg.sym)
    if cfg.mode == "int4":
        return OVWeightQuantizationConfig(
            bits=4, sym=cfg.sym, group_size=cfg.group_size, ratio=cfg.ratio
        )
    if cfg.mode == "full_int8":
        # A full-quantization config on a text-to-image pipeline quantizes the UNet's weights and
        # activations and gives the other models 8-bit weights (optimum-intel's pipeline rule).
        return OVQuantizationConfig(
            bits=8, sym=cfg.sym, dataset=list(cfg.calibration_prompts),
            num_samples=cfg.num_samples,
        )
    # hybrid: a dataset of prompts turns weight-only 8 bit into hybrid quantization (optimum-intel
    # switches quant_method to HYBRID when a text-to-image pipeline gets a dataset).
    return OVWeightQuantizationConfig(
        bits=8, sym=cfg.sym, dataset=list(cfg.calibration_prompts),
        num_samples=cfg.num_samples, quant_method="hybrid",
    )


def quantize(pipe: Any, qcfg: Any) -> None:
    """Apply `qcfg` to `pipe` in place with optimum-intel's OVQuantizer (what `from_pretrained(...,
    quantization_config=qcfg)` does), releasing the calibration run's compiled models first.

    Calibration compiles and runs the whole pipeline; optimum-intel keeps those compiled models
    until quantization ends, although NNCF compiles its own copies. On SD 1.5 that is 5 to 6 GB
    held through NNCF's statistics collection, the step with the highest memory.
    """
    from optimum.intel import OVConfig, OVQuantizer

    quantizer = OVQuantizer(pipe)
    dataset = None
    if qcfg.dataset is not None:  # hybrid, full_int8: calibrate on the prompts, then let go
        dataset = quantizer.dataset_builder.build_from_quantization_config(qcfg)
        pipe.clear_requests()
        release_memory()
    quantizer.quantize(calibration_dataset=dataset, ov_config=OVConfig(quantization_config=qcfg))


def compress(fp32_dir: Path, dst: Path, shape: StaticShape, cfg: CompressionConfig,
             finish: Any) -> dict[str, Any]:
    """Load the fp32 export with `cfg`'s compression applied, fix `shape`, save to `dst`.

    `finish(pipe, shape)` is the export's reshape-and-fix step (shared with the fp32 path).
    The fp32 folder is loaded with dynamic shapes: hybrid calibration runs the pipeline at the
    UNet's native size, whatever the static shape.
    """
    cls = families.detect(fp32_dir).export.ov_pipeline_class()
    qcfg = quantization_config(cfg)
    log.info("compressing %s (%s) with NNCF", fp32_dir, cfg.mode)
    start = time.perf_counter()
    # As in convert(): optimum's gc.collect() calls would walk every torch object. Collect first:
    # the pipelines timed before (reference cycles, GBs of compiled weights) would stay frozen.
    release_memory()
    gc.freeze()
    try:
        pipe = cls.from_pretrained(fp32_dir, compile=False)
        quantize(pipe, qcfg)
    finally:
        gc.unfreeze()
    seconds = time.perf_counter() - start
    finish(pipe, shape)
    pipe.save_pretrained(dst)
    log.info("compressed (%s) in %.1f s, saved to %s", cfg.mode, seconds, dst)
    return {"mode": cfg.mode, "seconds": round(seconds, 3)}


def compress_ir_weights(folder: Path, cfg: CompressionConfig) -> list[str]:
    """Every `openvino_model.xml` under `folder` with its weights compressed to 8 bit by NNCF, as
    optimum-intel's `int8` does (`--weight-format int8`), each file replaced whole: a run-time
    adapter's base (tasks/export/runtime.py), whose shapes stay dynamic. Returns the models done."""
    import nncf
    import openvino as ov

    mode = nncf.CompressWeightsMode.INT8_SYM if cfg.sym else nncf.CompressWeightsMode.INT8_ASYM
    core, done = ov.Core(), []
    for xml in sorted(folder.rglob("openvino_model.xml")):
        model = nncf.compress_weights(core.read_model(xml), mode=mode)
        tmp = xml.with_name("openvino_model.compressed.xml")
        ov.save_model(model, tmp, compress_to_fp16=False)
        del model
        os.replace(tmp.with_suffix(".bin"), xml.with_suffix(".bin"))  # a new file: links to the f32 stay f32
        os.replace(tmp, xml)
        done.append(str(xml.parent.relative_to(folder)))
    log.info("compressed the weights of %s to 8 bit (%s)", ", ".join(done), mode.value)
    return done
