"""Export: a diffusers pipeline folder to OpenVINO IR with optimum-intel, reshaped to static shapes.

Static shapes let OpenVINO compile every model for one known input size, the fast path on CPU
(issue 6 quotes 16.7 s dynamic vs 4.7 s static for SD 1.5 at 512 px). The exported folder loads
with `OVStableDiffusionPipeline.from_pretrained(out)` (or the XL class for SDXL); pass
`dynamic_shapes=False` (see tasks.common.openvino_model.load_ov_pipeline) to keep the static shapes.

Pure work on folders: no MLflow here; the CLI in __main__ logs and writes the report.
"""
from __future__ import annotations

import gc
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

from tasks.common import families
from tasks.common.errors import UserError
from tasks.common.genai import export_tokenizers
from tasks.common.memory import release_memory
from tasks.common.openvino_model import (
    StaticShape,
    folder_size_mb,
    is_openvino_folder,
    load_ov_pipeline,
    static_shape,
    write_runtime_config,
)
from tasks.export.compress import compress
from tasks.export.config import ExportConfig
from tasks.export.parity import pytorch_run, run_parity
from tasks.export.single_file import SINGLE_FILE, check_layout_supported, write_single_file
from tasks.export.source import materialize
from tasks.export.variants import add_ratios, compare, dynamic_latency

log = logging.getLogger(__name__)


def check_source(src: Path) -> type[families.ModelFamily]:
    """The source must be a diffusers pipeline folder (not an OpenVINO one); returns its family."""
    if not src.is_dir():
        raise UserError(
            f"{src} does not exist: run the train stage first (dvc repro train) or pass --model "
            "a diffusers pipeline folder"
        )
    if is_openvino_folder(src):
        raise UserError(f"{src} is already an OpenVINO export; pass the diffusers pipeline folder")
    return families.detect(src)


def fix_vae_decoder_batch(pipe: Any, images_per_call: int) -> None:
    """Give the VAE decoder the batch the UNet produces (prompts x images per prompt).

    optimum-intel 2.2.0's `reshape()` sizes the decoder's batch as `num_images_per_prompt` alone,
    so any `batch_size > 1` fails at decode time ("model input [1,4,32,32] and tensor (2.4.32.32)
    are incompatible"); the diffusers pipelines decode all latents of a call at once.
    """
    model = pipe.vae_decoder.model
    port = model.inputs[0]
    shape = port.get_partial_shape()
    shape[0] = images_per_call
    model.reshape({port: shape})


def free_text_encoder_batch(pipe: Any) -> None:
    """Leave the text encoders' batch axis dynamic (sequence length stays fixed at 77).

    optimum-intel's `from_pretrained(out)` (dynamic_shapes=True, its default) makes the UNet and
    VAE dynamic again on load but never the text encoders, so a folder exported at batch_size 2
    would then reject a single prompt. The text encoders run once per call, so a dynamic batch
    there costs nothing measurable; the UNet and VAE (all the denoising work) stay static.
    """
    for name in families.of_pipeline(pipe).text.encoder_names:
        part = getattr(pipe, name, None)
        if part is None:
            continue
        shapes = {}
        for port in part.model.inputs:
            shape = port.get_partial_shape()
            shape[0] = -1
            shapes[port] = shape
        part.model.reshape(shapes)


def fix_static_shape(pipe: Any, shape: StaticShape) -> None:
    """Reshape an OpenVINO pipeline to `shape` (UNet, VAE static; text encoders' batch free; where the
    family edits, the axes its input images change free: FLUX.2 klein's reference tokens)."""
    pipe.reshape(
        batch_size=shape.batch_size,
        height=shape.height,
        width=shape.width,
        num_images_per_prompt=shape.num_images_per_prompt,
    )
    fix_vae_decoder_batch(pipe, shape.images_per_call)
    free_text_encoder_batch(pipe)
    families.of_pipeline(pipe).export.free_reference_axes(pipe)  # an edit's input images: any size


def convert(src: Path, dst: Path, shape: StaticShape | None) -> dict[str, Any]:
    """Convert `src` into `dst` (an empty folder) at `shape` (None: dynamic shapes, with OpenVINO
    tokenizers for GenAI); returns timings and the class used."""
    family = check_source(src)
    cls = family.export.ov_pipeline_class()
    log.info("exporting %s (%s) to OpenVINO with %s", src, family.title, cls.__name__)
    start = time.perf_counter()
    # optimum-intel runs gc.collect() after each model it converts; with torch, diffusers and
    # transformers loaded, each full collection walks ~600k objects (10.6 s of 16 s CPU measured
    # for the tiny model). Freezing what exists now makes those collections skip it (2.2 s).
    # Collect first: a dead pipeline (a reference cycle) frozen would never be freed.
    release_memory()
    gc.freeze()
    try:
        pipe = cls.from_pretrained(src, export=True, compile=False)
    finally:
        gc.unfreeze()
    export_s = time.perf_counter() - start
    start = time.perf_counter()
    if shape is not None:
        fix_static_shape(pipe, shape)
    pipe.save_pretrained(dst)
    if shape is None:
        export_tokenizers(pipe, dst)
    save_s = time.perf_counter() - start
    del pipe
    release_memory()  # the export leaves GBs of torch and OpenVINO objects in reference cycles
    log.info("exported in %.1f s, reshaped and saved in %.1f s to %s", export_s, save_s, dst)
    return {"family": family.name, "pipeline_class": cls.__name__, "export_s": export_s,
            "save_s": save_s}


def component_sizes(path: Path) -> dict[str, float]:
    """MB per exported component (unet, vae_decoder, text_encoder, ...)."""
    return {
        sub.name: folder_size_mb(sub)
        for sub in sorted(path.iterdir())
        if sub.is_dir() and (sub / "openvino_model.xml").is_file()
    }


def _load_static(path: Path, wanted: StaticShape, precision: str) -> tuple[Any, float]:
    """Load an export back from disk at its static shape (and check it is `wanted`)."""
    start = time.perf_counter()
    pipe = load_ov_pipeline(path, static=True, precision=precision)
    load_s = time.perf_counter() - start
    got = static_shape(pipe)
    if got is None or got.images_per_call != wanted.images_per_call or (got.height, got.width) != (
        wanted.height, wanted.width
    ):
        raise RuntimeError(f"exported pipeline reloads with call shape {got}, expected {wanted}")
    return pipe, load_s


def export(src: Path, dst: Path, cfg: ExportConfig, base: Path | None = None) -> dict[str, Any]:
    """Materialize, convert, reload at the static shape, check parity, compress; the report.

    `src` is any train output (see source.py; adapters need `base`). `dst` receives the fp32
    export, or the compressed one when `export.compression.mode` is not 'none' (the fp32 export
    is then built in a temporary folder as the reference for parity and fidelity). Parity runs
    in f32; the other timings at `cfg.inference_precision`, which is recorded in `dst`.
    """
    src, dst = Path(src), Path(dst)
    wanted = StaticShape(cfg.batch_size, cfg.height, cfg.width, cfg.num_images_per_prompt)
    compressing = cfg.compression.mode != "none"
    with tempfile.TemporaryDirectory(prefix="export-") as work:
        source, source_info = materialize(src, base, Path(work), cfg.placeholder_token)
        if cfg.single_file != "none":
            check_layout_supported(families.read_index(source))
        fp32_dir = Path(work) / "openvino-fp32" if compressing else dst
        info = convert(source, fp32_dir, wanted)
        report: dict[str, Any] = {
            "source": str(src),
            "source_kind": source_info,
            "family": info["family"],
            "pipeline_class": info["pipeline_class"],
            "static_shape": wanted.as_dict(),
            "seconds": {"export": round(info["export_s"], 3), "reshape_save": round(info["save_s"], 3)},
            "size_mb": {"source": folder_size_mb(source), "openvino_fp32": folder_size_mb(fp32_dir)},
            "inference_precision": {"requested": cfg.inference_precision},
        }
        ref = _check_parity(report, source, fp32_dir, wanted, cfg)
        if compressing:
            _compress(report, fp32_dir, dst, wanted, cfg, ref)
        if cfg.single_file != "none":
            report["single_file"] = {
                "path": str(SINGLE_FILE),  # inside the export folder
                **write_single_file(source, dst / SINGLE_FILE, cfg.single_file),
            }
    write_runtime_config(dst, cfg.inference_precision)
    report["size_mb"]["openvino"] = folder_size_mb(dst)
    report["size_mb"]["components"] = component_sizes(dst)
    if "latency_s" in report:
        add_ratios(report["latency_s"])
    return report


def _check_parity(report: dict[str, Any], source: Path, fp32_dir: Path, wanted: StaticShape,
                  cfg: ExportConfig) -> Any:
    """Reload the fp32 export at its static shape; with `export.parity`, compare it with PyTorch and
    time it at the requested precision. Fills the report's load time, parity, latency and fidelity;
    returns the PyTorch reference the compressed export is compared with (None without parity)."""
    # One pipeline in memory at a time: PyTorch first, then each OpenVINO one, dropped and
    # collected before the next is loaded (SD 1.5: 4.3 GB in PyTorch, ~8 GB compiled).
    pt_run = None
    if cfg.parity.enabled:
        pt_run = pytorch_run(source, wanted, cfg.parity)
        release_memory()  # the PyTorch pipeline
    ov_pipe, load_s = _load_static(fp32_dir, wanted, "f32")
    report["seconds"]["load_compile"] = round(load_s, 3)
    if pt_run is None:
        report["parity"] = {"enabled": False, "passed": True}
        del ov_pipe
        return None
    report["parity"], latency, ref = run_parity(pt_run, ov_pipe, cfg.parity)
    del pt_run
    report["latency_s"] = latency
    latency["openvino_static_f32"] = latency.pop("openvino_static")
    precision = cfg.inference_precision
    if precision != "f32":  # at f32 the parity run's pipeline is the one to time
        del ov_pipe
        release_memory()
        ov_pipe, _ = _load_static(fp32_dir, wanted, precision)
    seconds, fidelity = compare(ov_pipe, ref, f"static {precision}")
    del ov_pipe
    release_memory()
    latency["openvino_static"] = round(seconds, 4)
    report["inference_precision"].update(fidelity)
    if cfg.latency_dynamic:
        latency["openvino_dynamic"] = round(dynamic_latency(fp32_dir, ref, precision), 4)
    return ref


def _compress(report: dict[str, Any], fp32_dir: Path, dst: Path, wanted: StaticShape, cfg: ExportConfig,
              ref: Any) -> None:
    """Compress the fp32 export into `dst`; with parity's reference `ref`, its latency and its
    fidelity to the fp32 export against `export.compression.min_psnr_db`."""
    report["compression"] = compress(fp32_dir, dst, wanted, cfg.compression, fix_static_shape)
    report["size_mb"]["openvino_compressed"] = folder_size_mb(dst)
    release_memory()  # the quantized pipeline and NNCF's copies
    if ref is None:
        return
    precision = cfg.inference_precision
    comp_pipe, _ = _load_static(dst, wanted, precision)
    seconds, fidelity = compare(comp_pipe, ref, f"{cfg.compression.mode} {precision}")
    report["latency_s"]["openvino_compressed"] = round(seconds, 4)
    limit = cfg.compression.min_psnr_db
    fidelity["min_psnr_db"] = limit
    fidelity["passed"] = fidelity["finite"] and (limit is None or fidelity["psnr_vs_openvino_fp32_db"] >= limit)
    report["compression"].update(fidelity)


def numeric_metrics(report: dict[str, Any]) -> dict[str, float]:
    """The report's numbers flattened for MLflow (`seconds.export`, `parity.image_psnr_db`...)."""
    out: dict[str, float] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{prefix}{key}.")
        elif isinstance(node, (int, float)) and not isinstance(node, bool):
            out[prefix[:-1]] = float(node)

    for key in ("seconds", "size_mb", "parity", "latency_s", "inference_precision", "compression", "memory_peak_mb",
                "single_file"):
        walk(report.get(key, {}), f"{key}.")
    return out
