"""Every image an evaluation scores, made one pipeline in memory at a time.

The order: the export's fidelity images (its static shape sets the call shape), the fine-tune's
(PyTorch; adapters load onto the base), then the base's, both in fp32 or both on a denoiser quantized
as it loads (`evaluate.base_model_precision`: Precision; the fine-tune's adapters then stay unfused);
the base's taken from the base image cache (base_cache.py) when an earlier evaluation of the same
base made them under the same protocol.
Each pipeline is dropped and its memory given back (release_memory: diffusers pipelines are full
of reference cycles) before the next one loads; the scoring encoders load only after the last
(core.evaluate). Each phase's peak RSS is recorded in a PhasePeaks: `export`, `finetuned`,
`base` (its load and images, or the cache read), and core's `score`.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from finetune_runtime.size import shape_of
from tasks.common import families
from tasks.common.finetuned import load_finetuned, load_pipeline
from tasks.common.genai import is_runtime_export, open_runtime_export
from tasks.common.memory import PhasePeaks, release_memory
from tasks.common.openvino_model import StaticShape, compiled_precisions, load_ov_pipeline, static_shape
from tasks.common.quantize import BasePrecision
from tasks.common.quantized_pipeline import compute_choice
from tasks.evaluate import base_cache as C
from tasks.evaluate import edits as E
from tasks.evaluate import extra_metrics as X
from tasks.evaluate import image_to_video as I
from tasks.evaluate.config import EvaluateConfig, quantized
from tasks.evaluate.generate import generate

log = logging.getLogger(__name__)

PRECISION = {"all": "f32"}  # what the fine-tune and the base are generated in (the gains': like with like)


@dataclass(frozen=True)
class Precision:
    """How the fine-tune and the base are both generated: fp32, or the denoiser quantized as it loads
    (`evaluate.base_model_precision`) and the rest in `dtype` (bf16 where the denoiser is stored in 16 bits
    and the CPU computes bf16 natively, else fp32: finetune_runtime/cpu_formats.py)."""

    quantize: BasePrecision | None = None
    dtype: Any = None

    @classmethod
    def of(cls, cfg: EvaluateConfig, model: Path, base: Path | None) -> Precision:
        held = quantized(cfg)
        if held is None:
            return cls()
        stored_in = Path(model) if (Path(model) / "model_index.json").is_file() or base is None else Path(base)
        dtype, why = compute_choice(stored_in)  # bf16 only where stored in 16 bits and the CPU computes it natively
        log.info("evaluate: the denoiser in %s, the rest in %s (%s)", held.name, str(dtype).removeprefix("torch."),
                 why)
        return cls(held, dtype)

    def describe(self) -> dict[str, str]:
        """The report's and the protocol's `precision` (PRECISION in fp32, so fp32 runs keep their ids),
        part of the base image cache's key."""
        if self.quantize is None:
            return dict(PRECISION)
        return {"all": {"torch.bfloat16": "bf16"}.get(str(self.dtype), "f32"), "denoiser": self.quantize.name}

    @property
    def label(self) -> str:
        if self.quantize is None:
            return "PyTorch fp32"
        return f"PyTorch {self.describe()['all']}, denoiser {self.quantize.name}"


def default_shape(pipe: Any) -> StaticShape:
    """For a dynamic pipeline: one prompt, one image per call, at the denoiser's native size."""
    height, width = shape_of(pipe, families.of_pipeline(pipe).call_convention()).default
    return StaticShape(1, height, width, 1)


def call_shape(pipe: Any, resolution: int | None) -> StaticShape:
    """The PyTorch call shape when no export sets it: `evaluate.resolution` px, else the native size."""
    return StaticShape(1, resolution, resolution, 1) if resolution else default_shape(pipe)


def load_base(path: Path, precision: Precision | None = None) -> Any:
    """The base pipeline as the fine-tune is loaded: fp32, or its denoiser quantized (`precision`)."""
    families.read_index(path, "run the base stage (dvc repro base)")
    return load_pipeline(path, precision.quantize, precision.dtype) if precision else load_pipeline(path)


@dataclass
class Jobs:
    """What every model generates: the prompts, and the drift / held-out / edit sets when enabled."""

    main: dict[str, Any]
    drift: dict[str, Any] | None
    heldout: dict[str, Any] | None
    edits: dict[str, Any] | None = None  # E.generate's arguments: the triples, seed, steps, guidance
    i2v: dict[str, Any] | None = None  # I.generate's: the subject clips' first frames, shape, seed, steps, guidance

    def run(self, pipe: Any, who: str) -> dict[str, Any]:
        if self.edits:  # before any image: a family without reference inputs is refused
            E.refuse_family(families.of_pipeline(pipe), self.edits["triples"])
        out = {"main": generate(pipe, desc=who, **self.main)}
        if self.drift:
            out["drift"] = generate(pipe, desc=f"{who}: class prompts", **self.drift)
        if self.heldout:
            out["heldout"] = generate(pipe, desc=f"{who}: held-out captions", **self.heldout)
        if self.edits:
            out["edits"] = E.generate(pipe, desc=f"{who}: edits", **self.edits)
        if self.i2v:
            out["i2v"] = I.generate(pipe, desc=f"{who}: image-to-video", **self.i2v)
        return out

    def settings(self) -> dict[str, Any]:
        """Every job's arguments as plain JSON (the call shape as a dict, the edit set as its content
        hash): what, with the base and its precision, decides the base's images (the cache key)."""
        out: dict[str, Any] = {}
        for name in ("main", "drift", "heldout", "edits", "i2v"):
            job = getattr(self, name)
            if job is None:
                continue
            plain = dict(job)
            if isinstance(plain.get("shape"), StaticShape):
                plain["shape"] = plain["shape"].as_dict()
            if "triples" in plain:
                plain["triples"] = {"set": E.set_hash(plain["triples"]), "pairs": len(plain["triples"])}
            if plain.get("image"):
                plain["image"] = E.images_hash(plain["image"])
            if "starts" in plain:
                plain["starts"] = I.starts_hash(plain["starts"])
            out[name] = plain
        return out


@dataclass
class Generated:
    """Every image the evaluation scores, with how it was made and how long it took."""

    tuned: dict[str, Any]  # job name -> (images, seconds) of the fine-tune
    based: dict[str, Any]  # the same for the base; empty when it is not compared
    exported: dict[str, Any] | None  # the export's fidelity images (export_images)
    jobs: Jobs
    heldout: Any  # (captions, images) of the held-out set, or None
    shape: StaticShape
    source: dict[str, Any]  # what load_finetuned read
    seconds: dict[str, float]
    base_cache: str | None = None  # hit | miss | off; None when the base is not compared
    precision: dict[str, str] = field(default_factory=lambda: dict(PRECISION))  # Precision.describe()


def export_images(export: Path, prompts: list[str], cfg: EvaluateConfig) -> dict[str, Any]:
    """The export's images of the fidelity prompts, with its call shape, backend and precision."""
    if is_runtime_export(export):  # export.adapters: runtime: GenAI, base + the run-time adapter
        pipe = open_runtime_export(export, cfg.guidance_scale)
        shape, backend = pipe.shape, "openvino-genai-adapter"
    else:
        families.read_index(export, "run the export stage (dvc repro export), or set "
                            "evaluate.export_fidelity.enabled: false")
        pipe = load_ov_pipeline(export, static=True)
        shape = static_shape(pipe)
        backend = "openvino-static" if shape else "openvino-dynamic"
    shape = shape or default_shape(pipe)
    n = cfg.export_fidelity.max_prompts or len(prompts)
    images, seconds = generate(
        pipe, prompts[:n], shape, cfg.images_per_prompt, cfg.seed, cfg.num_inference_steps,
        cfg.guidance_scale, desc=f"fine-tuned ({backend}, export fidelity)")
    # what the export's openvino_runtime.json made OpenVINO compute in
    precision = ({n: "f32" for n in families.ov_component_names(families.of_pipeline(pipe))}
                 if backend == "openvino-genai-adapter" else compiled_precisions(pipe))
    return {"images": images, "seconds": seconds, "shape": shape, "backend": backend,
            "precision": precision}


def _jobs(prompts: list[str], cfg: EvaluateConfig, shape: StaticShape, with_base: bool, heldout_data: Any,
          triples: list[E.Triple], family: type[families.ModelFamily], starts: list[I.Start]) -> Jobs:
    common = dict(shape=shape, seed=cfg.seed, num_inference_steps=cfg.num_inference_steps,
                  guidance_scale=cfg.guidance_scale)
    if family.call_convention().min_input_images:  # no image from a prompt alone: the prompts edit the edit
        common["image"] = [triples[0].references[0]]  # set's first reference (core.evaluate refuses no set)
    return Jobs(
        main=dict(prompts=prompts, images_per_prompt=cfg.images_per_prompt, **common),
        drift=dict(prompts=X.drift_prompts(cfg.drift.prompts, cfg.identifier, cfg.class_name),
                   images_per_prompt=cfg.drift.images_per_prompt, **common)
        if cfg.drift.enabled and with_base else None,
        heldout=dict(prompts=heldout_data[0], images_per_prompt=1, **common) if heldout_data else None,
        edits=dict(triples=triples, seed=cfg.seed, num_inference_steps=cfg.num_inference_steps,
                   guidance_scale=cfg.guidance_scale) if triples else None,
        i2v=dict(starts=starts, images_per_prompt=cfg.images_per_prompt, shape=shape, seed=cfg.seed,
                 num_inference_steps=cfg.num_inference_steps, guidance_scale=cfg.guidance_scale) if starts else None,
    )


def generate_all(model: Path, base: Path | None, with_base: bool, prompts: list[str], cfg: EvaluateConfig,
                 heldout: Path | None, export: Path | None, triples: list[E.Triple],
                 peaks: PhasePeaks, starts: list[I.Start] | None = None) -> Generated:
    """The export's fidelity images, the fine-tune's and, `with_base`, the base's (see the module
    docstring): one pipeline in memory at a time, each phase's peak RSS into `peaks`. `starts`: the
    subject clips both models continue from their first frames (image_to_video.py; none: no such job)."""
    heldout_data = X.load_heldout(heldout, cfg.heldout.max_images) if cfg.heldout.enabled else None
    exported = None
    if cfg.export_fidelity.enabled and export is not None:
        with peaks.phase("export"):
            exported = export_images(export, prompts, cfg)
            release_memory()  # the OpenVINO pipeline, before the PyTorch one loads
    precision = Precision.of(cfg, model, base)
    with peaks.phase("finetuned"):
        pipe, _, source = load_finetuned(model, base, quantize=precision.quantize, dtype=precision.dtype)
        shape = exported["shape"] if exported else call_shape(pipe, cfg.resolution)
        log.info("generating %d x %d images in %s at %s", len(prompts), cfg.images_per_prompt, precision.label,
                 shape)
        jobs = _jobs(prompts, cfg, shape, with_base, heldout_data, triples, families.of_pipeline(pipe), starts or [])
        tuned = jobs.run(pipe, f"fine-tuned ({precision.label})")
        del pipe
        release_memory()
    seconds = {"generate_finetuned": round(sum(v[1] for v in tuned.values()), 3)}
    based: dict[str, Any] = {}
    state = None
    if with_base:
        with peaks.phase("base"):
            based, state, seconds["generate_base"] = _base_images(Path(base), jobs, cfg, precision)
    if exported:
        seconds["generate_export"] = round(exported["seconds"], 3)
    return Generated(tuned, based, exported, jobs, heldout_data, shape, source, seconds, state, precision.describe())


def _base_images(base: Path, jobs: Jobs, cfg: EvaluateConfig,
                 precision: Precision) -> tuple[dict[str, Any], str, float]:
    """The base's images of every job, the cache's state (hit | miss | off) and the seconds spent:
    on a hit, reading the cache (the base pipeline is never loaded); else generating them."""
    cache = C.BaseImageCache.open(cfg.base_cache_dir, base, jobs.settings(), precision.describe())
    if cache is not None:
        start = time.perf_counter()
        cached = cache.load()
        if cached is not None:
            log.info("base images from the cache %s (the base pipeline is not loaded)", cache.path)
            return cached, "hit", round(time.perf_counter() - start, 3)
    pipe = load_base(base, precision)
    based = jobs.run(pipe, f"base ({precision.label})")
    del pipe
    release_memory()
    if cache is not None:
        cache.store(based)
    return based, "miss" if cache is not None else "off", round(sum(v[1] for v in based.values()), 3)
