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

import numpy as np

from finetune_runtime.layout import LORA_WEIGHTS as LORA_NAME
from tasks.common import families
from tasks.common.errors import UserError
from tasks.common.finetuned import detect
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
from tasks.common.psnr import psnr_db
from tasks.export.compress import compress_ir_weights
from tasks.export.config import CompressionConfig, ExportConfig
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
    if family.export.genai_lora_prefixes is None:
        raise UserError(f"export.adapters: runtime is not available for {family.title} (its LoRA "
                        f"keys have not been checked against OpenVINO GenAI): {fix}")
    from safetensors import safe_open

    with safe_open(kind.lora, "pt") as fh:
        parts = {key.split(".")[0] for key in fh.keys()}  # noqa: SIM118 (safe_open is not a dict)
    if extra := sorted(parts - set(family.export.genai_lora_prefixes)):
        raise UserError(f"{kind.lora} has LoRA layers for {', '.join(extra)}, which OpenVINO GenAI "
                        f"does not apply to {family.title} at run time (it takes "
                        f"{', '.join(family.export.genai_lora_prefixes)}): train without train_text_encoder, {fix}")
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
            _publish(work / "export", cached)
            link_tree(cached, dst)
    finally:
        if cache_dir:
            shutil.rmtree(work, ignore_errors=True)
    return {**info, "export_s": round(made["export_s"] + made["save_s"], 3)}


def _publish(made: Path, cached: Path) -> None:
    """Move a finished export into the cache in one rename: an entry is whole or absent. When a
    concurrent export of the same key got there first, its entry is kept (and `made` dropped)."""
    try:
        os.replace(made, cached)
    except OSError:
        if not (cached / "model_index.json").is_file():
            raise


def compressed_base_export(f32: Path, key: str, dst: Path, comp: CompressionConfig,
                           cache_dir: Path | None) -> dict[str, Any]:
    """`f32` (a base export) with its weights compressed by NNCF into `dst`, cached under `key` and
    the compression's settings; the f32 files are never changed (they may be the cache's)."""
    ckey = f"{key}-{comp.mode}-{'sym' if comp.sym else 'asym'}-nncf{version('nncf')}"
    cached = cache_dir / ckey if cache_dir else None
    if cached is not None and (cached / "model_index.json").is_file():
        link_tree(cached, dst)
        return {"key": ckey, "cache_hit": True, "seconds": 0.0}
    work = Path(tempfile.mkdtemp(prefix=".compress-", dir=cache_dir or dst.parent))
    try:
        start = time.perf_counter()
        link_tree(f32, work / "export")
        compress_ir_weights(work / "export", comp)
        seconds = time.perf_counter() - start
        if cached is not None:
            _publish(work / "export", cached)
            link_tree(cached, dst)
        else:
            os.replace(work / "export", dst)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"key": ckey, "cache_hit": False, "seconds": round(seconds, 3)}


def export_runtime(src: Path, dst: Path, cfg: ExportConfig, base: Path | None) -> dict[str, Any]:
    """Export for run-time adapters (see the module docstring); returns the report."""
    lora, family = _check_source(Path(src), base)
    base = Path(base)
    cache = Path(cfg.base_cache_dir) if cfg.base_cache_dir else None
    compressed = cfg.compression.mode != "none"
    scratch = Path(tempfile.mkdtemp(prefix=".f32-", dir=dst)) if compressed else None
    try:
        return _export_runtime(Path(src), lora, family, base, dst, cfg, cache, scratch)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def _export_runtime(src: Path, lora: Path, family: type[families.ModelFamily], base: Path, dst: Path,
                    cfg: ExportConfig, cache: Path | None, scratch: Path | None) -> dict[str, Any]:
    """export_runtime's body; with compression, the f32 base export goes to `scratch` (the parity
    gate's reference) and the compressed one to dst/base."""
    import torch

    shape = StaticShape(cfg.batch_size, cfg.height, cfg.width, cfg.num_images_per_prompt)
    f32_dir = scratch / BASE_DIR if scratch is not None else dst / BASE_DIR
    made = base_export(base, f32_dir, cache)
    pipe = family.pipeline.diffusers_class().from_pretrained(base, dtype=torch.float32)
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
        report["parity"], report["latency_s"] = {"enabled": False, "passed": True}, {}
        f32_images = _genai_images(f32_dir, dst / GENAI_LORA_NAME, shape, cfg)[0] if scratch else None
    else:
        report["parity"], report["latency_s"], f32_images = _genai_parity(pt, f32_dir, dst / GENAI_LORA_NAME,
                                                                          shape, cfg)
    if scratch is not None and not report["parity"]["passed"]:
        return report  # the stage fails on it: no NNCF pass, no cache entry
    if scratch is not None:
        report["compression"] = {"mode": cfg.compression.mode, "sym": cfg.compression.sym, **compressed_base_export(
            f32_dir, made["key"], dst / BASE_DIR, cfg.compression, cache)}
        _compression_fidelity(report, f32_images, dst, shape, cfg)
        made["served_key"] = report["compression"]["key"]  # the int8 base's: what the registry keys on
        shutil.rmtree(scratch)  # before the sizes below
    write_runtime_config(dst, "f32")
    adapter = {"base_key": made.get("served_key", made["key"]), "base_fingerprint": made["base_fingerprint"],
               "family": family.name, "lora_source_sha256": sha256_file(lora), "lora_layers": layers,
               "file": GENAI_LORA_NAME, "static_shape": shape.as_dict()}
    (dst / ADAPTER_FILE).write_text(json.dumps(adapter, indent=2) + "\n")
    report["size_mb"] = {"base": folder_size_mb(dst / BASE_DIR),
                         "adapter": round((dst / GENAI_LORA_NAME).stat().st_size / 2**20, 3),
                         "openvino": folder_size_mb(dst)}
    return report


def _genai_images(base_dir: Path, adapter_file: Path, shape: StaticShape, cfg: ExportConfig) -> tuple[
    Any, list[float], float
]:
    """GenAI's images of the parity call with the adapter: (images, both calls' seconds, load seconds)."""
    import openvino_genai

    start = time.perf_counter()
    pipe = load_text2image(base_dir, shape, cfg.parity.guidance_scale, "f32", [adapter_file])
    load_s = time.perf_counter() - start
    adapter = [(openvino_genai.Adapter(str(adapter_file)), 1.0)]
    p = cfg.parity
    timings = []
    for _ in range(2):  # the second call is the one timed (the first pays one-off set-up)
        start = time.perf_counter()
        images = generate(pipe, p.prompt, shape, p.num_inference_steps, p.guidance_scale, p.seed, adapter)
        timings.append(time.perf_counter() - start)
    del pipe
    return images, timings, load_s


def _genai_parity(pt: Any, base_dir: Path, adapter_file: Path, shape: StaticShape, cfg: ExportConfig) -> tuple[
    dict[str, Any], dict[str, Any], Any
]:
    """GenAI (f32 base + adapter) against the PyTorch fine-tune's images: (parity, latency, images)."""
    images, timings, load_s = _genai_images(base_dir, adapter_file, shape, cfg)
    section = parity_section(pt.images, images, cfg.parity)
    section["against"] = "PyTorch base + LoRA (unfused) vs OpenVINO GenAI base + run-time adapter"
    latency = {"images_per_call": shape.images_per_call, "num_inference_steps": cfg.parity.num_inference_steps,
               "pytorch_eager": round(pt.seconds, 4), "genai_load_compile": round(load_s, 3),
               "genai_first_call": round(timings[0], 4), "genai": round(timings[1], 4)}
    log.info("runtime parity: PSNR %.1f dB (%s)", section["image_psnr_db"],
             "ok" if section["passed"] else "FAILED")
    return section, latency, images


def _compression_fidelity(report: dict[str, Any], f32_images: Any, dst: Path, shape: StaticShape,
                          cfg: ExportConfig) -> None:
    """The compressed base + adapter against the f32 base + adapter, gated by
    `export.compression.min_psnr_db` as the fused export's compression is; its latency is the endpoint's."""
    images, timings, load_s = _genai_images(dst / BASE_DIR, dst / GENAI_LORA_NAME, shape, cfg)
    psnr, limit = psnr_db(images, f32_images), cfg.compression.min_psnr_db
    finite = bool(np.isfinite(images).all())
    report["compression"].update({"psnr_vs_openvino_fp32_db": round(psnr, 3), "finite": finite, "min_psnr_db": limit,
                                  "passed": finite and (limit is None or psnr >= limit)})
    report["latency_s"].update({"genai_compressed_load_compile": round(load_s, 3),
                                "genai_compressed": round(timings[1], 4)})
    log.info("runtime %s base: PSNR vs f32 %.1f dB", cfg.compression.mode, psnr)
