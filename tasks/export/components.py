"""Export one component at a time (`export.components: one_at_a_time`): never the whole pipeline.

The default path (core.py) loads the whole pipeline in fp32 through optimum-intel and the parity
gate loads it again: FLUX.2 klein 4B is ~30 GB in fp32, FLUX.1-dev over 60 GB. Here each group of
models (each text encoder, the denoiser, the VAE's encoder and decoder) is loaded alone, in the
dtype its weights are stored in (bf16 in float32 on a CPU without native bf16, where it would be
emulated ~500x slower: `load_dtypes`), converted with optimum-intel's own export configs, checked
against its PyTorch source on the same seeded inputs, weight-compressed (int8/int4) and written,
then freed before the next loads. The other heavy models of the pipeline are built on the `meta`
device (config only, no weights) so that optimum-intel's per-family export functions see a whole
pipeline. The VAE, small in every family, is always loaded.

When every component is written, the folder gets what optimum-intel writes beside the models
(model_index.json, configs, tokenizers, scheduler), is loaded by the family's OV*Pipeline (IR
weights memory-mapped, nothing compiled), reshaped to the static shape as the default path does
(`fix_static_shape`) and saved to `dst`. Nothing reaches `dst` when a component fails its parity.
"""
from __future__ import annotations

import gc
import importlib
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from finetune_runtime import cpu_formats
from tasks.common import families
from tasks.common.errors import UserError
from tasks.common.genai import export_tokenizers
from tasks.common.memory import PhasePeaks, release_memory
from tasks.common.openvino_model import StaticShape, folder_size_mb, load_ov_pipeline, write_runtime_config
from tasks.export import component_check as check
from tasks.export.config import ExportConfig
from tasks.export.core import check_source, component_sizes, fix_static_shape
from tasks.export.parity import pytorch_run, run_parity
from tasks.export.source import materialize

log = logging.getLogger(__name__)

VAE_PARTS = ("vae_encoder", "vae_decoder")
#: One model's phase peaked at about this many times its stored weights (FLUX.2 [klein] 4B,
#: benchmarks/flux2_klein: Qwen3-4B 7.7 GB -> 21.4 GB, the transformer 7.4 GB -> 21.2 GB)
PHASE_PER_WEIGHT = 2.9
#: The least any measured conversion took (the same models in the chain through DVC, under tcmalloc:
#: 7.7 GB -> 18.3 GB): a group that needs more than the memory available even at this is refused
PHASE_PER_WEIGHT_MIN = 2.3
_GB = 2 ** 30


def groups(index: dict[str, Any], family: type[families.ModelFamily]) -> list[tuple[str, tuple[str, ...]]]:
    """(pipeline component loaded, OpenVINO models written from it), in export order: text
    encoders, denoiser, then the VAE (last: its pass writes the pipeline's other files)."""
    present = {k for k, v in index.items() if isinstance(v, list) and v[0] is not None}
    out = [(name, (name,)) for name in family.text.encoder_names if name in present]
    out.append((family.denoiser.name, (family.denoiser.name,)))
    out.append(("vae", VAE_PARTS))
    return out


def available_bytes() -> int | None:
    """The memory the system can give without swapping (MemAvailable), or None where there is no /proc."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def load_dtypes(folder: Path, say: bool = True) -> dict[str, Any]:
    """The dtype each component loads in, and its PyTorch reference runs in: the stored one, except
    bf16 on a CPU that would emulate it (AVX2 only: ~500x slower), where it is float32, twice the
    memory (finetune_runtime/cpu_formats.py). `say`: log the choice."""
    import torch

    stored = families.stored_dtypes(folder)
    widened = [name for name, dtype in stored.items() if dtype == torch.bfloat16]
    if not widened:
        return stored
    choice = cpu_formats.auto_bf16(key="auto")
    if say:
        log.info("export: precision of %s (stored in bf16): %s", ", ".join(widened), choice.line())
    if choice.precision == "bf16":
        return stored
    return {**stored, **{name: torch.float32 for name in widened}}


def preflight(folder: Path) -> dict[str, float]:
    """Before anything loads: {group: GB of stored weights}. A group whose conversion needs more than
    the memory available now even at the least measured ratio (PHASE_PER_WEIGHT_MIN times its weights)
    is refused (it would page for hours, not fail); one whose usual ratio (PHASE_PER_WEIGHT) exceeds
    it is warned about."""
    import torch

    index = families.read_index(folder)
    stored, loads = families.stored_dtypes(folder), load_dtypes(folder, say=False)
    weights = {real: sum(p.stat().st_size for p in (folder / real).rglob("*") if p.suffix in (".safetensors", ".bin"))
               for real, _ in groups(index, families.from_index(index))}
    widened = {real for real in weights if loads.get(real) == torch.float32 and stored.get(real) == torch.bfloat16}
    loaded = {real: size * (2 if real in widened else 1) for real, size in weights.items()}
    largest = max(loaded, key=loaded.get)
    need, available = loaded[largest], available_bytes()
    held = ("in float32 (stored in bf16, which this CPU would emulate)" if largest in widened
            else "in its stored dtype")
    if available is not None and PHASE_PER_WEIGHT_MIN * need > available:
        raise UserError(
            f"export.components: one_at_a_time: {largest} holds {need / _GB:.1f} GB of weights {held}; "
            f"{available / _GB:.1f} GB of memory is available and converting it takes about "
            f"{PHASE_PER_WEIGHT * need / _GB:.0f} GB (its weights, the traced model and the checked copy): export "
            "on a machine with that much memory, or set export.enabled: false to evaluate and register the "
            "PyTorch fine-tune without an export (nothing was loaded or written)")
    if available is not None and PHASE_PER_WEIGHT * need > available:
        log.warning("export: %s (%.1f GB of weights) may take about %.0f GB to convert; %.1f GB is available",
                    largest, need / _GB, PHASE_PER_WEIGHT * need / _GB, available / _GB)
    return {real: round(size / _GB, 2) for real, size in weights.items()}


def _model_class(spec: list[str]) -> type | None:
    """The class of a model_index.json entry when it is a torch module (None for tokenizers,
    schedulers, processors)."""
    import torch

    if spec[0] not in ("diffusers", "transformers"):
        return None
    cls = getattr(importlib.import_module(spec[0]), spec[1], None)
    return cls if isinstance(cls, type) and issubclass(cls, torch.nn.Module) else None


def _meta_model(folder: Path, cls: type) -> Any:
    """`cls` built from its config on the meta device: its structure and config, no weights."""
    import torch
    from diffusers import ModelMixin

    with torch.device("meta"):
        if issubclass(cls, ModelMixin):
            return cls.from_config(cls.load_config(folder))
        from transformers import AutoConfig

        return cls._from_config(AutoConfig.from_pretrained(folder))


def load_for(src: Path, index: dict[str, Any], real: str, dtypes: dict[str, Any]) -> Any:
    """The diffusers pipeline of `src` with `real` (and the small VAE) loaded in their stored
    dtypes and every other torch model on the meta device."""
    import diffusers
    import torch

    overrides = {}
    for name, spec in index.items():
        if name in (real, "vae") or name.startswith("_") or not isinstance(spec, list) or spec[0] is None:
            continue
        cls = _model_class(spec)
        if cls is not None:
            overrides[name] = _meta_model(src / name, cls)
    pipe_cls = getattr(diffusers, index["_class_name"])
    dtype = {name: dtypes.get(name, torch.float32) for name in (real, "vae")}
    return pipe_cls.from_pretrained(src, torch_dtype=dtype, **overrides)


def _convert(models: dict[str, Any], out: Path, patch_16bit: bool) -> None:
    """Write each (module, export config) of `models` as `out/<name>/openvino_model.xml` with its
    config, as optimum-intel's export_from_model does for a diffusers pipeline."""
    from optimum.exporters.openvino.convert import _set_runtime_options, export_models
    from optimum.utils import DEFAULT_DUMMY_SHAPES

    for name, (module, _) in models.items():
        if hasattr(module, "save_config"):
            module.save_config(out / name)
        elif hasattr(module, "config") and hasattr(module.config, "save_pretrained"):
            module.config.save_pretrained(out / name)
    _set_runtime_options(models, "text-to-image", "diffusers", False)
    shapes = {k: v for k, v in DEFAULT_DUMMY_SHAPES.items() if k not in ("height", "width")}
    export_models(models, out, output_names=[f"{name}/openvino_model.xml" for name in models],
                  input_shapes=shapes, stateful=False, patch_16bit_model=patch_16bit, library_name="diffusers")


def _write_pipeline_files(pipe: Any, out: Path) -> None:
    """What optimum-intel writes beside the models: scheduler, tokenizers, model_index.json."""
    pipe.scheduler.save_pretrained(out / "scheduler")
    for name in ("feature_extractor", "safety_checker", *families.of_pipeline(pipe).text.tokenizer_names):
        part = getattr(pipe, name, None)
        if part is not None:
            part.save_pretrained(out / name)
    pipe.save_config(out)


def _group_pass(src: Path, index: dict[str, Any], real: str, parts: tuple[str, ...], stage: Path,
                cfg: ExportConfig, dtypes: dict[str, Any]) -> dict[str, Any]:
    """Load, convert, check and compress one group; returns {part: its report entry}. The PyTorch
    references run first, on the module as loaded (the conversion patches and traces it)."""
    import torch
    from optimum.exporters.openvino.convert import get_diffusion_models_for_export_ext
    from optimum.exporters.tasks import TasksManager

    pipe = load_for(src, index, real, dtypes)
    TasksManager.standardize_model_attributes(pipe, library_name="diffusers")
    _, every = get_diffusion_models_for_export_ext(pipe, exporter="openvino")
    models = {name: every[name] for name in parts}
    dtype = dtypes.get(real, torch.float32)
    refs = _references(models, cfg.parity.seed, dtype) if cfg.parity.enabled else {}
    start = time.perf_counter()
    _convert(models, stage, patch_16bit=dtype in (torch.float16, torch.bfloat16))
    seconds = round(time.perf_counter() - start, 3)
    if real == "vae":
        _write_pipeline_files(pipe, stage)
    del pipe, models, every
    release_memory()  # the PyTorch weights go before the IRs are compiled and compressed
    dtype_name = str(dtype).removeprefix("torch.")
    return {name: _check_part(stage / name / "openvino_model.xml", refs.get(name), cfg,
                              {"source": real, "dtype": dtype_name, "convert_s": seconds})
            for name in parts}


def _references(models: dict[str, Any], seed: int, dtype: Any) -> dict[str, tuple[dict[str, Any], Any]]:
    """{model: (its seeded example inputs, the PyTorch module's first output on them)}."""
    from optimum.utils import DEFAULT_DUMMY_SHAPES

    shapes = {k: v for k, v in DEFAULT_DUMMY_SHAPES.items() if k not in ("height", "width")}
    refs = {}
    for name, (module, export_config) in models.items():
        inputs = check.rounded(check.reference_inputs(export_config, seed, shapes), dtype)
        refs[name] = (inputs, check.pytorch_output(module, export_config, inputs))
    return refs


def _check_part(xml: Path, ref: tuple[dict[str, Any], Any] | None, cfg: ExportConfig,
                entry: dict[str, Any]) -> dict[str, Any]:
    """The written IR against its PyTorch reference (when parity is on), then compressed (when
    asked and the parity holds), the compressed IR's error recorded beside."""
    start = time.perf_counter()
    if ref is not None:
        inputs, expected = ref
        entry.update(check.compare(expected, check.openvino_output(xml, inputs)))
        entry["passed"] = _passes(entry, cfg.parity.component_max_rel)
        entry["check_s"] = round(time.perf_counter() - start, 3)
    if cfg.compression.mode != "none" and entry.get("passed", True):
        start = time.perf_counter()
        entry["compression"] = check.compress_ir(xml, cfg.compression)
        entry["compression"]["seconds"] = round(time.perf_counter() - start, 3)
        if ref is not None:
            entry["compression"]["max_rel"] = check.compare(expected, check.openvino_output(xml, inputs))["max_rel"]
    return entry


def _passes(entry: dict[str, Any], limit: float | None) -> bool:
    return bool(entry["finite"]) and (limit is None or entry["max_rel"] <= limit)


def streamed_source(src: Path, base: Path | None, work: Path) -> tuple[Path, dict[str, Any]] | None:
    """A train output holding only a LoRA (or DoRA) file, fused into `base`'s weight files one shard
    at a time (tasks/common/stream_fuse.py), in their stored dtype; None for any other output or a
    file that cannot stream (source.py then fuses it in a pipeline loaded whole, in fp32)."""
    from tasks.common import stream_fuse
    from tasks.common.finetuned import detect

    kind = detect(src)
    if kind.full_pipeline or kind.embeds is not None or kind.lora is None or not kind.lora.is_file():
        return None
    if base is None or not (Path(base) / "model_index.json").is_file():
        return None  # materialize() says what to pass
    names = [k for k, v in families.read_index(base).items() if isinstance(v, list) and v[0] is not None]
    fuse, why = stream_fuse.plan(Path(base), kind.lora, names)
    if fuse is None:
        log.info("the LoRA cannot stream into the base (%s): fused in memory", why)
        return None
    need = sum(p.stat().st_size for name in fuse.layers for p in (Path(base) / name).glob("*.safetensors"))
    if need > (free := shutil.disk_usage(work).free):
        raise UserError(f"export: fusing the LoRA into {', '.join(fuse.layers)} writes {need / _GB:.1f} GB into the "
                        f"temporary folder {work.parent} (TMPDIR), where {free / _GB:.1f} GB is free: free disk there "
                        "or point TMPDIR at a disk that has it (nothing was written)")
    out = work / "fused-pipeline"
    out.mkdir()
    layers = stream_fuse.fuse_to(Path(base), out, fuse)
    return out, {"method": kind.method, "base": str(base), "lora": str(kind.lora), "streamed_fuse": layers}


def convert_components(source: Path, stage: Path, cfg: ExportConfig, peaks: PhasePeaks) -> dict[str, Any]:
    """Every group of `source` converted into `stage`, one in memory at a time; stops at the first
    component that fails its parity. Returns the report's `components` section."""
    index = families.read_index(source)
    family = families.from_index(index)
    dtypes = load_dtypes(source)
    done: dict[str, Any] = {}
    for real, parts in groups(index, family):
        log.info("one component at a time: %s -> %s (%s)", real, ", ".join(parts), dtypes.get(real))
        release_memory()
        gc.freeze()  # as in core.convert(): optimum's gc.collect() calls skip what exists now
        try:
            with peaks.phase(real):
                done.update(_group_pass(source, index, real, parts, stage, cfg, dtypes))
        finally:
            gc.unfreeze()
            release_memory()
        for name in parts:
            done[name]["peak_rss_mb"] = peaks.peaks.get(real)
        if any(done[name].get("passed") is False for name in parts):
            break
    return done


def export_components(src: Path, dst: Path, cfg: ExportConfig, base: Path | None = None) -> dict[str, Any]:
    """The `export.components: one_at_a_time` export of `src` (any train output, as core.export) into
    `dst`, and its report. On a component's parity failure `dst` is left untouched and the report
    says which (`parity.passed` false, `parity.failed_components`)."""
    src, dst = Path(src), Path(dst)
    wanted = StaticShape(cfg.batch_size, cfg.height, cfg.width, cfg.num_images_per_prompt)
    peaks = PhasePeaks()
    pipeline = next((f for f in (src, base) if f is not None and (Path(f) / "model_index.json").is_file()), None)
    weights_gb = preflight(Path(pipeline)) if pipeline is not None else {}  # none: materialize() says what to pass
    with tempfile.TemporaryDirectory(prefix="export-components-") as work:
        streamed = streamed_source(src, base, Path(work))
        source, source_info = streamed or materialize(src, base, Path(work), cfg.placeholder_token)
        family = check_source(source)
        stage = Path(work) / "openvino-components"
        start = time.perf_counter()
        parts = convert_components(source, stage, cfg, peaks)
        failed = [name for name, entry in parts.items() if entry.get("passed") is False]
        report: dict[str, Any] = {
            "source": str(src), "source_kind": source_info, "family": family.name,
            "pipeline_class": family.export.ov_pipeline_class().__name__, "components_mode": "one_at_a_time",
            "static_shape": wanted.as_dict(), "seconds": {"export": round(time.perf_counter() - start, 3)},
            "size_mb": {"source": folder_size_mb(source)},
            "parity": {"enabled": cfg.parity.enabled, "passed": not failed, "failed_components": failed,
                       "component_max_rel": cfg.parity.component_max_rel, "components": parts},
            "memory_peak_mb": dict(peaks.peaks), "weights_gb": weights_gb,
        }
        if cfg.compression.mode != "none":
            report["compression"] = {"mode": cfg.compression.mode, "per_component": True}
        if failed:
            return report
        with peaks.phase("reshape_save"):
            _reshape_save(stage, dst, wanted, report)
        write_runtime_config(dst, cfg.inference_precision)
        report["size_mb"]["openvino"] = folder_size_mb(dst)
        report["size_mb"]["components"] = component_sizes(dst)
        if cfg.parity.enabled and cfg.parity.pipeline_image:
            with peaks.phase("pipeline_image"):
                _pipeline_image(report, source, dst, wanted, cfg)
    report["memory_peak_mb"] = dict(peaks.peaks)
    return report


def _reshape_save(stage: Path, dst: Path, wanted: StaticShape, report: dict[str, Any]) -> None:
    """Load the converted folder with the family's OV*Pipeline (nothing compiled), fix the static
    shape as the default path does, save to `dst`."""
    start = time.perf_counter()
    cls = families.detect(stage).export.ov_pipeline_class()
    pipe = cls.from_pretrained(stage, compile=False)
    fix_static_shape(pipe, wanted)
    pipe.save_pretrained(dst)
    export_tokenizers(pipe, dst)  # OpenVINO GenAI tokenizes in OpenVINO: <tokenizer>/openvino_tokenizer.xml
    del pipe
    release_memory()
    shutil.rmtree(stage, ignore_errors=True)  # the IRs now live in dst
    report["seconds"]["reshape_save"] = round(time.perf_counter() - start, 3)


def _pipeline_image(report: dict[str, Any], source: Path, dst: Path, wanted: StaticShape,
                    cfg: ExportConfig) -> None:
    """The whole-pipeline image check (core.py's parity run) on the written export, at the export's
    static shape: PyTorch in fp32, then OpenVINO at f32, never both in memory. With compression the
    threshold is export.compression.min_psnr_db (the written models are the compressed ones)."""
    pt_run = pytorch_run(source, wanted, cfg.parity)
    release_memory()
    ov_pipe = load_ov_pipeline(dst, static=True, precision="f32")
    image, latency, _ = run_parity(pt_run, ov_pipe, cfg.parity)
    del ov_pipe, pt_run
    release_memory()
    if cfg.compression.mode != "none":
        limit = cfg.compression.min_psnr_db
        image["min_psnr_db"] = limit
        image["passed"] = image["finite"] and (limit is None or image["image_psnr_db"] >= limit)
    image.pop("enabled", None)
    report["parity"]["pipeline_image"] = image
    report["parity"]["image_psnr_db"] = image["image_psnr_db"]
    report["parity"]["passed"] = report["parity"]["passed"] and image["passed"]
    report["latency_s"] = latency
