"""`export.adapters: runtime`: the base exported once, the fine-tune's LoRA kept beside it.

The output folder (models/openvino) then holds

- `base/`: the base pipeline in OpenVINO IR with dynamic shapes and OpenVINO tokenizers, what
  GenAI's Text2ImagePipeline loads; taken from `export.base_cache_dir` when a fine-tune of the
  same base (same fingerprint, same optimum-intel and OpenVINO) was exported before;
- `genai_lora.safetensors`: the LoRA in the layout GenAI applies at run time (tasks/common/genai.py);
- `runtime_adapter.json`: what the adapter is and which base it goes with (fingerprints);
- `openvino_runtime.json`: f32, the precision the parity gate checked.

The parity gate compares GenAI (base + adapter) with the PyTorch fine-tune (base + the LoRA,
unfused) on the parity prompt, seed and steps: the adapter must reproduce the fine-tune, not only
convert.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

from tasks.common import families
from tasks.common.errors import UserError
from tasks.common.finetuned import LORA_NAME, detect
from tasks.common.fingerprint import folder_fingerprint, sha256_file
from tasks.common.genai import (
    ADAPTER_FILE,
    BASE_DIR,
    GENAI_LORA_NAME,
    generate,
    load_text2image,
    write_genai_lora,
)
from tasks.common.memory import release_memory
from tasks.common.openvino_model import StaticShape, folder_size_mb, write_runtime_config
from tasks.common.outputs import link_tree
from tasks.export.config import ExportConfig
from tasks.export.core import check_source, convert
from tasks.export.parity import parity_section, pytorch_call

log = logging.getLogger(__name__)

def _check_source(src: Path, base: Path | None) -> tuple[Path, type[families.ModelFamily]]:
    """The LoRA file of `src` and the base's family; UserErrors name what runtime cannot take."""
    kind = detect(src)
    fix = "or set export.adapters: fused"
    if kind.embeds is not None:
        raise UserError(f"{src} holds textual-inversion embeddings, which GenAI cannot add to its "
                        f"tokenizer at run time: {fix}")
    if kind.lora is None or kind.lora.name != LORA_NAME:
        raise UserError(f"{src} holds no {LORA_NAME} (a LoRA or DoRA train output; LoKr and LoHa "
                        f"are peft's own layers): train.method lora with train.lora_type lora, {fix}")
    if base is None:
        raise UserError("export.adapters: runtime needs --base, the pipeline the LoRA was trained on")
    family = check_source(Path(base))
    if family.genai_lora_prefixes is None:
        raise UserError(f"export.adapters: runtime is not available for {family.title} (its LoRA "
                        f"keys have not been checked against OpenVINO GenAI): {fix}")
    return kind.lora, family


def base_key(base: Path) -> str:
    """What a base export depends on: the base's files and the converting libraries' versions."""
    parts = [folder_fingerprint(base)] + [f"{p}=={version(p)}" for p in
                                          ("optimum-intel", "openvino", "openvino-tokenizers")]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def base_export(base: Path, dst: Path, cache_dir: Path | None) -> dict[str, Any]:
    """Write the dynamic-shape export of `base` to `dst`, from the cache when it holds it."""
    key = base_key(base)
    cached = cache_dir / key if cache_dir else None
    info: dict[str, Any] = {"key": key, "base_fingerprint": folder_fingerprint(base), "cache_hit": False}
    if cached is not None and (cached / "model_index.json").is_file():
        link_tree(cached, dst)
        return {**info, "cache_hit": True, "export_s": 0.0}
    if cache_dir:
        cache_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".base-", dir=cache_dir)) if cache_dir else dst
    try:
        made = convert(base, work / "export" if cache_dir else dst, None)
        if cached is not None:
            os.replace(work / "export", cached)  # whole or absent: never a half-written entry
            link_tree(cached, dst)
    finally:
        if cache_dir:
            shutil.rmtree(work, ignore_errors=True)
    return {**info, "export_s": round(made["export_s"] + made["save_s"], 3)}


def export_runtime(src: Path, dst: Path, cfg: ExportConfig, base: Path | None) -> dict[str, Any]:
    """Export for run-time adapters (see the module docstring); returns the report."""
    import torch

    lora, family = _check_source(Path(src), base)
    base = Path(base)
    shape = StaticShape(cfg.batch_size, cfg.height, cfg.width, cfg.num_images_per_prompt)
    cache = Path(cfg.base_cache_dir) if cfg.base_cache_dir else None
    made = base_export(base, dst / BASE_DIR, cache)
    pipe = family.pipeline_class().from_pretrained(base, torch_dtype=torch.float32)
    pipe.load_lora_weights(lora.parent, weight_name=lora.name)
    try:
        layers = write_genai_lora(pipe, dst / GENAI_LORA_NAME)
    except ValueError as err:  # a DoRA layer
        raise UserError(f"{lora}: {err}; set export.adapters: fused") from None
    report: dict[str, Any] = {
        "source": str(src), "source_kind": {"method": "lora", "lora": str(lora)},
        "family": family.name, "pipeline_class": "openvino_genai.Text2ImagePipeline",
        "adapters": "runtime", "static_shape": shape.as_dict(), "base_export": made,
        "seconds": {"export": made["export_s"]},
        "inference_precision": {"requested": cfg.inference_precision, "used": "f32"},
    }
    pt = pytorch_call(pipe, shape, cfg.parity) if cfg.parity.enabled else None
    del pipe
    release_memory()
    if pt is None:
        report["parity"] = {"enabled": False, "passed": True}
    else:
        report["parity"], report["latency_s"] = _genai_parity(pt, dst, shape, cfg)
    write_runtime_config(dst, "f32")
    adapter = {"base_key": made["key"], "base_fingerprint": made["base_fingerprint"],
               "family": family.name, "lora_source_sha256": sha256_file(lora), "lora_layers": layers,
               "file": GENAI_LORA_NAME, "static_shape": shape.as_dict()}
    (dst / ADAPTER_FILE).write_text(json.dumps(adapter, indent=2) + "\n")
    report["size_mb"] = {"base": folder_size_mb(dst / BASE_DIR),
                         "adapter": round((dst / GENAI_LORA_NAME).stat().st_size / 2**20, 3),
                         "openvino": folder_size_mb(dst)}
    return report


def _genai_parity(pt: Any, dst: Path, shape: StaticShape, cfg: ExportConfig) -> tuple[
    dict[str, Any], dict[str, Any]
]:
    """GenAI (base + adapter) against the PyTorch fine-tune's images: (parity, latency) sections."""
    import openvino_genai

    adapter_file = dst / GENAI_LORA_NAME
    start = time.perf_counter()
    pipe = load_text2image(dst / BASE_DIR, shape, cfg.parity.guidance_scale, "f32", [adapter_file])
    load_s = time.perf_counter() - start
    adapter = [(openvino_genai.Adapter(str(adapter_file)), 1.0)]
    p = cfg.parity
    timings = []
    for _ in range(2):  # the second call is the one timed (the first pays one-off set-up)
        start = time.perf_counter()
        images = generate(pipe, p.prompt, shape, p.num_inference_steps, p.guidance_scale, p.seed, adapter)
        timings.append(time.perf_counter() - start)
    del pipe
    section = parity_section(pt.images, images, p)
    section["against"] = "PyTorch base + LoRA (unfused) vs OpenVINO GenAI base + run-time adapter"
    latency = {"images_per_call": shape.images_per_call, "num_inference_steps": p.num_inference_steps,
               "pytorch_eager": round(pt.seconds, 4), "genai_load_compile": round(load_s, 3),
               "genai_first_call": round(timings[0], 4), "genai": round(timings[1], 4)}
    log.info("runtime parity: PSNR %.1f dB (%s)", section["image_psnr_db"],
             "ok" if section["passed"] else "FAILED")
    return section, latency
