"""Train: load the base, check the data, run the shared loop with the configured method, save.

No MLflow here: the CLI passes callbacks that log. `train()` returns everything the report needs.
"""
from __future__ import annotations

import csv
import logging
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from finetune_runtime.cpu_formats import Choice
from tasks.common import families
from tasks.common.errors import UserError
from tasks.common.fingerprint import weight_hashes
from tasks.common.memory import PhasePeaks, release_memory
from tasks.common.outputs import atomic_dir, atomic_file, check_replaceable
from tasks.common.quantize import BasePrecision, is_quantized
from tasks.train.backend import caches_on_host
from tasks.train.checkpoints import CheckpointManager, run_key
from tasks.train.clips import CLIPS_METADATA
from tasks.train.concepts import examples_report
from tasks.train.config import TrainConfig
from tasks.train.data import METADATA
from tasks.train.loop import LoopResult, device_type, make_accelerator, run_loop
from tasks.train.methods.base import TrainingMethod
from tasks.train.models import load_components
from tasks.train.no_ops import data_no_ops
from tasks.train.optim import optimizer_name, weight_dtype
from tasks.train.references import refuse_reference_settings, refuse_references
from tasks.train.selection import CheckpointJudge, best_record
from tasks.train.steplog import Callback, StepLog
from tasks.train.trained import trained_settings
from tasks.train.validation import live_validator, output_validation

log = logging.getLogger(__name__)


@dataclass
class TrainOutcome:
    method: str
    family: str
    history: list[StepLog]  # steps run by this process
    losses: list[list[float]]  # [step, loss, lr] of the whole run, resumed steps included
    seconds: float  # the loop only
    total_seconds: float  # loading + loop + saving + validation
    images: int
    weights: dict[str, str]
    validation: dict[str, list[Image.Image]]
    resumed_from: int | None
    checkpoint_dir: Path | None
    peak_memory_mb: float
    checkpoints: list[dict[str, Any]]  # one record per scored checkpoint (selection.py), with its folder
    selected: dict[str, Any]  # what went to --out
    buckets: dict[str, int] = field(default_factory=dict)  # instance images per 'HxW' bucket
    cache_seconds: float = 0.0  # the latent cache filled before the first step
    text_cache_seconds: float = 0.0  # the text cache filled before the first step
    concepts: dict[str, dict[str, Any]] = field(default_factory=dict)  # per concept: images, repeats, examples seen
    base_precision: dict[str, Any] = field(default_factory=dict)  # the frozen base's: name, quantized layers
    phase_peaks_mb: dict[str, float] = field(default_factory=dict)  # peak RSS of text_cache, load, steps, save
    trained: dict[str, Any] = field(default_factory=dict)  # what trained: adapter, optimizer, masks (trained.py)
    precision: Choice | None = None  # the mixed precision that ran and why (auto: by the CPU's native formats)

    def report(self) -> dict[str, Any]:
        """reports/train.json (DVC metrics)."""
        tail = [h[1] for h in self.losses[-10:]]
        step_seconds = [h.seconds for h in self.history]
        return {
            "method": self.method,
            "family": self.family,
            **self.trained,
            **({"mixed_precision": self.precision.precision, "precision_why": self.precision.why}
               if self.precision else {}),
            "steps": int(self.losses[-1][0]) if self.losses else 0,
            "final_loss": self.losses[-1][1] if self.losses else float("nan"),
            "mean_loss_last_10": sum(tail) / len(tail) if tail else float("nan"),
            "resumed_from_step": self.resumed_from,
            "seconds": round(self.seconds, 3),
            "total_seconds": round(self.total_seconds, 3),
            "latent_cache_seconds": round(self.cache_seconds, 3),
            "text_cache_seconds": round(self.text_cache_seconds, 3),
            "median_step_seconds": round(statistics.median(step_seconds), 4) if step_seconds else 0.0,
            "images_per_second": round(self.images / self.seconds, 3) if self.seconds > 0 and self.images else 0.0,
            "peak_memory_mb": round(self.peak_memory_mb, 1),
            "peak_rss_mb_by_phase": self.phase_peaks_mb,
            "weights_sha256": self.weights,
            "checkpoints": self.checkpoints,
            "selected_checkpoint": self.selected,
            **({"buckets": self.buckets} if self.buckets else {}),
            **({"concepts": self.concepts} if self.concepts else {}),
            "base_model_precision": self.base_precision.get("name", "none"),
            "text_encoder_precision": self.base_precision.get("text", "none"),
            **({"quantized_layers": self.base_precision["layers"]} if "layers" in self.base_precision else {}),
        }


def _refuse_data_no_ops(cfg: TrainConfig, method: TrainingMethod, dataset: Any) -> None:
    """A setting the instance images make moot (tasks/train/no_ops.py) fails before any weights load."""
    captions_used = method.caption_column is not None and cfg.spec.reads_captions
    records = dataset.instances
    sizes = [r.image_size() for r in records] if cfg.enable_bucket else []  # (from the metadata, else a header)
    problems = data_no_ops(cfg, sizes, any(r.tags for r in records), captions_used)
    if problems:
        raise UserError("params.yaml: " + "; ".join(problems))


def _settings(cfg: TrainConfig) -> None:
    if cfg.allow_tf32 and torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def _data_files(cfg: TrainConfig, method: TrainingMethod, family: Any, data_dir: Path,
                class_dir: Path | None) -> list[Path]:
    """The metadata files the run key hashes: the instance images' (a video family's clips'), and the
    class images' with prior preservation (train.concepts: one per concept)."""
    files = [Path(data_dir) / (CLIPS_METADATA if family.video else METADATA)]
    if cfg.with_prior_preservation and class_dir is not None:
        files += method.class_files or [Path(class_dir) / METADATA]
    return files


def _judge(cfg: TrainConfig, prompts: list[str], data_dir: Path, accelerator: Any, family: Any
           ) -> CheckpointJudge | None:
    """What scores the checkpoints (train.checkpoint_scoring), or None: rank 0 scores, the others
    receive its records; a video family's validation clips are scored frame by frame."""
    if not cfg.scores_checkpoints:
        return None
    return CheckpointJudge(cfg.checkpoint_scoring, prompts, data_dir, accelerator.is_main_process,
                           family.call_convention().frames or 1)


def train(
    cfg: TrainConfig,
    base: Path,
    data_dir: Path,
    class_dir: Path | None,
    out_dir: Path,
    callbacks: list[Callback] = (),  # type: ignore[assignment]
) -> TrainOutcome:
    """Fine-tune `base` on `data_dir` (+ `class_dir`) and write the method's output to `out_dir`.

    `out_dir` appears only complete: it is written to a temporary sibling, loaded back through
    diffusers' own loaders for the validation images, and moved into place last. Checkpoints go
    to `cfg.checkpoints_dir/<run key>/`, and `cfg.resume` continues from one.
    """
    from accelerate.utils import set_seed

    start = time.perf_counter()
    check_replaceable(out_dir)  # hours before the output is written
    base = Path(base)
    family = families.detect(base)
    cfg.check_family(family)  # a method or option the family lacks: refused before any load
    cfg = cfg.with_scoring_from(None)  # keys the CLI did not fill from params.yaml: their defaults
    _settings(cfg)
    cfg, precision = cfg.with_precision_chosen(device_type())  # explicit bf16 on a CPU emulating it: refused
    log.info("%s", precision.line("train.mixed_precision"))
    accelerator = make_accelerator(cfg)
    set_seed(cfg.seed)
    method = cfg.spec.trainer_class()(cfg)
    dataset, cfg = (method.dataset(Path(data_dir), Path(class_dir) if class_dir else None, family.video),
                    method.cfg)  # fails fast
    _refuse_data_no_ops(cfg, method, dataset)
    refuse_references(family, dataset.instances)  # edit datasets: a family that takes references,
    refuse_reference_settings(cfg, dataset.instances)  # and no class images beside them
    key, info = run_key(cfg, base, _data_files(cfg, method, family, data_dir, class_dir), accelerator.num_processes)
    checkpoints = CheckpointManager(Path(cfg.checkpoints_dir) / key, cfg.checkpoints_total_limit, accelerator, info,
                                    cfg.keep_checkpoints_every_steps)
    checkpoints.remove_abandoned()  # .partial folders of saves a crash interrupted
    resume_from = checkpoints.resolve(cfg.resume)
    peaks = PhasePeaks()
    components, base_info = _load_parts(cfg, base, method, accelerator, peaks)
    prompts = cfg.validation_prompts or method.validation_prompts()
    validate = live_validator(method, base, cfg, accelerator, prompts)
    judge = _judge(cfg, prompts, Path(data_dir), accelerator, family)
    with peaks.phase("steps"):  # the latent cache's fill included
        result = run_loop(method, dataset, cfg, accelerator, checkpoints, resume_from, callbacks, validate, judge)
    selected = _select_output(cfg, result, checkpoints)
    result.anchor.check(result.params, cfg.method, result.state.step, result.last_lr)  # never an unmoved output

    images: dict[str, list[Image.Image]] = {}
    weights: dict[str, str] = {}
    trained_keys = trained_settings(cfg, dataset.instances, optimizer_name(cfg, result.params))
    if result.ema is not None:
        result.ema.copy_to_params()  # the output is the EMA weights, as in train_text_to_image.py
    del validate, judge  # the live validator and the scoring encoders are done
    trained = _hand_over(result, method, accelerator, checkpoints)
    if accelerator.is_main_process:
        with peaks.phase("save"), atomic_dir(out_dir) as tmp:
            method.save(base, tmp, trained)
            _drop(trained, method)
            method.complete_output(base, tmp)  # LoRA: loads the base to fuse into, with nothing beside it
            images = output_validation(method, tmp, base, cfg, prompts)
        weights = weight_hashes(Path(out_dir))
    else:
        _drop(trained, method)
    accelerator.wait_for_everyone()
    peak = max((h.peak_memory_mb for h in result.history), default=0.0)
    concepts = examples_report(dataset.layout, dataset.instances, _summed(method.concepts_seen, accelerator))
    return TrainOutcome(
        method=cfg.method, family=components.family.name, history=result.history, losses=result.state.history,
        seconds=result.seconds, total_seconds=time.perf_counter() - start, images=result.images, weights=weights,
        validation=images, resumed_from=result.resumed_from, checkpoint_dir=checkpoints.run_dir,
        peak_memory_mb=peak, buckets=dataset.bucket_counts(), cache_seconds=result.cache_seconds,
        text_cache_seconds=method.text_cache_seconds,
        checkpoints=[_on_disk(r, checkpoints.run_dir / f"checkpoint-{r['step']}") for r in result.state.scores],
        selected=selected, concepts=concepts, base_precision=base_info, phase_peaks_mb=peaks.peaks,
        trained=trained_keys, precision=precision,
    )


def _load_parts(cfg: TrainConfig, base: Path, method: TrainingMethod, accelerator: Any, peaks: PhasePeaks
                ) -> tuple[Any, dict[str, Any]]:
    """The base's parts, bound to `method`: text encoders first (with the text cache on, they encode
    every prompt and go), then the denoiser, never beside T5; each phase's peak RSS into `peaks`.
    Returns the components and the quantized base's report entry."""
    quantize = base_precision(cfg, accelerator.device)
    text_quantize = base_precision(cfg, accelerator.device, "text_encoder_precision")
    with peaks.phase("text_cache"):
        components = load_components(base, cfg.prediction_type, denoiser=False, text_quantize=text_quantize)
        method.bind(components)
        dtype = weight_dtype(accelerator.mixed_precision)
        if caches_on_host(accelerator):  # frozen parts in low precision; with the text cache on, text encoders gone
            method.place_frozen_first(accelerator.device, dtype)
    with peaks.phase("load"):
        components.load_denoiser(base, method.denoiser_load_dtype(dtype, accelerator.device), quantize)
    return components, {**quantized_report(quantize, components.denoiser),
                        **({"text": text_quantize.name} if text_quantize else {})}


def base_precision(cfg: TrainConfig, device: torch.device, key: str = "base_model_precision"
                   ) -> BasePrecision | None:
    """The quantized base `train.<key>` asks for, refused where the device has no kernels."""
    quantize = BasePrecision.parse(getattr(cfg, key), key)
    if quantize is not None and (problem := quantize.problem(device.type, key=key)):
        raise UserError(f"params.yaml: {problem}")
    return quantize


def quantized_report(quantize: BasePrecision | None, denoiser: torch.nn.Module) -> dict[str, Any]:
    """{name, layers}: the quantized base's precision and how many of the denoiser's Linear layers hold it."""
    if quantize is None:
        return {}
    layers = sum(1 for m in denoiser.modules() if isinstance(m, torch.nn.Linear) and is_quantized(m.weight))
    log.info("%s: %d Linear layers of the denoiser quantized as they loaded", quantize.name, layers)
    return {"name": quantize.name, "layers": layers}


def _summed(counts: Counter, accelerator: Any) -> Counter:
    """Examples seen per concept on every rank together."""
    if accelerator.num_processes == 1:
        return counts
    from accelerate.utils import gather_object

    return sum((Counter(c) for c in gather_object([dict(counts)])), Counter())


def _hand_over(result: LoopResult, method: TrainingMethod, accelerator: Any, checkpoints: CheckpointManager
               ) -> dict[str, torch.nn.Module]:
    """The trained modules, with every other thing training held let go of first: the optimizer and
    its state, accelerate's prepared objects, the EMA, the caches, the frozen modules. The output is
    then written (and the base loaded again for it) without the training's memory beside it."""
    trained, result.trained, result.ema, result.params = result.trained, {}, None, []
    bf16 = accelerator.mixed_precision == "bf16" and method.cfg.bf16_weights(accelerator.device.type)
    for module in trained.values():
        module.to(memory_format=torch.contiguous_format)  # safetensors stores contiguous tensors
        if bf16:  # full_bf16: the output in the base's float32
            module.float()
    checkpoints.untrack()
    accelerator.free_memory()  # prepared models, optimizer, LR scheduler, data loader
    method.release(keep=set(trained))
    release_memory()
    return trained


def _drop(trained: dict[str, torch.nn.Module], method: TrainingMethod) -> None:
    """Let the trained modules go too (their part of the output is written)."""
    trained.clear()
    method.release()
    release_memory()


def _on_disk(record: dict[str, Any], path: Path) -> dict[str, Any]:
    """A checkpoint's record for the report: its folder, and whether pruning has kept it."""
    return {**record, "path": str(path), "kept": path.is_dir()}


def _select_output(cfg: TrainConfig, result: Any, checkpoints: CheckpointManager) -> dict[str, Any]:
    """Put the chosen weights into the trained modules: the last step's, or the best healthy checkpoint's.

    Never a collapsed one: with `last`, a scored last step that collapsed fails the stage, naming
    the best healthy checkpoint instead.
    """
    scoring = cfg.checkpoint_scoring
    records = result.state.scores
    step = result.state.step
    chosen: dict[str, Any] = {"select": cfg.select_checkpoint, "step": step, "stopped_early": result.stopped_early}
    if records:
        metric, goal = scoring.scored_metric(), str(scoring.goal)
        best = best_record(records, metric, goal)
        chosen.update(metric=metric, goal=goal, best_step=best["step"] if best else None)
        if cfg.select_checkpoint == "best":
            if best is None:
                raise UserError("every scored checkpoint collapsed (" + "; ".join(
                    f"step {r['step']}: {r['collapse_reason']}" for r in records) + "): nothing healthy to output. "
                    "Lower train.learning_rate or raise lr_warmup_steps, and checkpoint more often "
                    "(train.checkpointing_steps)")
            if best["step"] != step or result.stopped_early:
                checkpoints.load_weights(checkpoints.run_dir / f"checkpoint-{best['step']}", result.trained)
            chosen.update(step=best["step"], value=best[metric])
        last = records[-1]
        if cfg.select_checkpoint == "last" and last["step"] == step and last["collapsed"]:
            hint = f"the best healthy checkpoint is step {best['step']}: " if best else ""
            raise UserError(f"the last step ({step}) collapsed ({last['collapse_reason']}), so it is not written to "
                            f"--out; {hint}set train.select_checkpoint: best, or lower train.learning_rate")
    log.info("output: %s checkpoint, step %d%s", cfg.select_checkpoint, chosen["step"],
             f" ({chosen['metric']} {chosen['value']:.4f})" if "value" in chosen else "")
    return chosen


def write_loss_csv(path: Path, losses: list[list[float]]) -> None:
    """step,loss,lr per optimizer step of the whole run: the DVC plot of the loss curve."""
    with atomic_file(path) as tmp, open(tmp, "w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(["step", "loss", "lr"])
        for step, loss, lr in losses:
            writer.writerow([int(step), f"{loss:.6g}", f"{lr:.6g}"])
