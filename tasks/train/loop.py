"""The one training loop every method shares.

Reads top to bottom: the method configures what trains; build optimizer and LR schedule over its
parameters; let accelerate prepare what trains (device, mixed precision, gradient accumulation,
and the distributed wrappers when launched that way); restore a checkpoint if resuming; then step
until `max_train_steps`, clipping gradients, updating the EMA, checkpointing, validating and
reporting each step to callbacks.

Never lose progress: SIGTERM/SIGINT finish the current step, save a checkpoint and stop; any other
exception saves the state of the last completed step before it propagates; a non-finite loss or
gradient stops the run before it poisons the weights and keeps the last good checkpoint.

The checkpoint that is best, not the last: with a `judge` (selection.py) every checkpoint's
validation images are scored before it is saved (the scores travel in the checkpoint), the best
healthy one so far is kept out of pruning, and with `select_checkpoint: best` a divergence ends
the run instead of failing it (core.py then writes the best checkpoint).
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from tasks.common.errors import UserError
from tasks.common.memory import release_memory
from tasks.train.backend import choose_backend
from tasks.train.buckets import BucketBatchSampler
from tasks.train.checkpoints import CheckpointManager, TrainState, register_weight_hooks
from tasks.train.config import TrainConfig
from tasks.train.data import EpochSampler
from tasks.train.ema import Ema
from tasks.train.interrupts import StopFlag, TrainingInterrupted, stop_on_signals
from tasks.train.methods.base import TrainingMethod
from tasks.train.optim import evaluating, make_lr_scheduler, make_optimizer, set_training, weight_dtype
from tasks.train.selection import CheckpointJudge, WeightsAnchor
from tasks.train.steplog import Callback, RngSnapshot, StepLog, peak_memory_mb

log = logging.getLogger(__name__)

Validate = Callable[[int, dict[str, torch.nn.Module]], dict[str, list[Image.Image]]]


class TrainingDiverged(UserError):
    """The loss or gradient became NaN or infinite; the message says at which step and what to change."""


@dataclass
class LoopResult:
    history: list[StepLog]  # steps run by this process (not those restored from a checkpoint)
    state: TrainState  # position and the whole run's [step, loss, lr] history
    seconds: float
    images: int
    trained: dict[str, torch.nn.Module]  # unwrapped trained modules, for the method's save()
    resumed_from: int | None
    ema: Ema | None
    params: list[torch.Tensor]  # the trainable tensors, in optimizer order
    anchor: WeightsAnchor  # their values before step 1
    last_lr: float = 0.0
    stopped_early: str | None = None  # why training ended before max_train_steps (select best: divergence)
    cache_seconds: float = 0.0  # filling the latent cache before the first step (not in `seconds`)


def device_type() -> str:
    """The device type this process trains on, known before its Accelerator exists: xla where
    torch_xla is installed (accelerate then runs on it), else accelerate's device (cuda, cpu, ...)."""
    from accelerate import PartialState
    from accelerate.utils import is_torch_xla_available

    return "xla" if is_torch_xla_available() else PartialState().device.type


def make_accelerator(cfg: TrainConfig) -> Any:
    """A fresh accelerate `Accelerator` for this run (CPU or GPU; distributed when launched so).

    accelerate keeps its state in process-wide singletons; resetting the per-run part lets one
    process (a test session) run trainings with different precision settings one after another.
    """
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import is_torch_xla_available

    if is_torch_xla_available():  # accelerate then runs on torch_xla; SPMD must be on before its device exists
        from tasks.train.xla import start_runtime

        start_runtime(cfg.xla)
    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    return Accelerator(
        mixed_precision=cfg.mixed_precision, gradient_accumulation_steps=cfg.gradient_accumulation_steps
    )


def build_dataloader(dataset: Dataset, method: TrainingMethod, cfg: TrainConfig) -> tuple[DataLoader, Any]:
    """Order from (seed, epoch); the loader's own generator keeps it off the global RNG.

    With buckets, or an edit dataset whose targets have different numbers of reference images, a batch
    sampler makes batches within one group: one bucket, one reference count (tasks/train/buckets.py).
    With the disk latent cache, the dataset reads the latents it finds there instead of decoding.
    """
    if hasattr(dataset, "read_latents_from"):  # after the back end chose the caches (XLA turns them off)
        dataset.read_latents_from(method.disk_latents())
    common = {"collate_fn": method.collate, "num_workers": cfg.dataloader_num_workers,
              "generator": torch.Generator().manual_seed(cfg.seed)}
    groups = dataset.batch_groups() if hasattr(dataset, "batch_groups") else None
    if groups is not None:
        batches = BucketBatchSampler(groups, cfg.train_batch_size, cfg.seed)
        return DataLoader(dataset, batch_sampler=batches, **common), batches
    sampler = EpochSampler(len(dataset), cfg.seed)  # type: ignore[arg-type]
    return DataLoader(dataset, batch_size=cfg.train_batch_size, sampler=sampler, **common), sampler


def _check_finite(value: float, what: str, step: int, lr: float, checkpoints: CheckpointManager | None) -> None:
    if math.isfinite(value):
        return
    last = (f" The last good checkpoint is {checkpoints.run_dir / f'checkpoint-{checkpoints.last_saved}'}"
            " (set train.resume to that folder)." if checkpoints and checkpoints.last_saved else "")
    raise TrainingDiverged(
        f"the {what} became {value} at step {step} (learning rate {lr:.3g}). Lower train.learning_rate, raise "
        f"train.lr_warmup_steps, or train with mixed_precision bf16/no instead of fp16.{last}"
    )


def _check_weights(params: list[torch.Tensor], step: int, lr: float, checkpoints: CheckpointManager | None) -> None:
    """Before a checkpoint is written: never save weights that already hold NaN or inf."""
    with torch.no_grad():
        finite = bool(torch.stack([p.isfinite().all() for p in params]).all()) if params else True
    if not finite:
        _check_finite(float("nan"), "weights", step, lr, checkpoints)


def run_loop(
    method: TrainingMethod,
    dataset: Dataset,
    cfg: TrainConfig,
    accelerator: Any,
    checkpoints: CheckpointManager | None = None,
    resume_from: Path | None = None,
    callbacks: list[Callback] = (),  # type: ignore[assignment]
    validate: Validate | None = None,
    judge: CheckpointJudge | None = None,
) -> LoopResult:
    """Train until `cfg.max_train_steps` optimizer steps; returns the history and the trained modules."""
    loop = _Loop(method, cfg, accelerator, checkpoints, list(callbacks), validate, judge)
    loop.prepare(dataset, resume_from)
    start = time.perf_counter()
    bar = tqdm(total=cfg.max_train_steps, initial=loop.state.step, desc=f"train {method.name}", unit="step",
               disable=None if accelerator.is_local_main_process else True)
    with stop_on_signals() as stop:
        loop.log_start()
        try:
            loop.train(stop, bar)
        except TrainingDiverged as err:
            if judge is None or cfg.select_checkpoint != "best" or judge.best(loop.state.scores) is None:
                raise
            loop.stopped = str(err)
            log.warning("training stopped early: %s; the best healthy checkpoint becomes the output", err)
        except TrainingInterrupted:
            raise
        except Exception:
            loop.save_on_failure()
            raise
        finally:
            bar.close()
            loop.backend.close()
    return loop.finish(start)


@dataclass
class _Step:
    """What one optimizer step gathers over its micro-batches (they may span an epoch's end)."""

    losses: list[torch.Tensor] = field(default_factory=list)
    extras: dict[str, list[float]] = field(default_factory=dict)
    images: int = 0
    data_seconds: float = 0.0
    grad_norm: float = float("nan")
    start: float = field(default_factory=time.perf_counter)


class _Loop:
    """One run of the loop: prepare, then epochs of micro-steps, each optimizer step ended by
    `end_of_step` (log, checkpoint, validate, score, stop on request); `save_on_failure` on error."""

    def __init__(self, method: TrainingMethod, cfg: TrainConfig, accelerator: Any,
                 checkpoints: CheckpointManager | None, callbacks: list[Callback], validate: Validate | None,
                 judge: CheckpointJudge | None) -> None:
        self.method, self.cfg, self.accelerator = method, cfg, accelerator
        self.checkpoints, self.callbacks, self.validate, self.judge = checkpoints, callbacks, validate, judge
        self.history: list[StepLog] = []
        self.lr, self.run_images, self.stopped = float("nan"), 0, None
        self.resumed_from: int | None = None

    def prepare(self, dataset: Dataset, resume_from: Path | None) -> None:
        """Place the method's modules, build optimizer, schedule and data, let accelerate wrap what trains,
        restore a checkpoint when resuming."""
        method, cfg, accelerator = self.method, self.cfg, self.accelerator
        method.configure()
        self.trainable = method.trainable()
        modules = method.components.modules
        method.place(accelerator.device, weight_dtype(accelerator.mixed_precision))
        release_memory()  # the float32 weights the cast replaced: back to the system before the text encoders run
        method.setup_caches()
        self.n_proc = accelerator.num_processes
        optimizer = make_optimizer(cfg, method.param_groups(), cfg.effective_learning_rate(self.n_proc))
        self.backend = choose_backend(cfg, accelerator)  # XLA, CPU acceleration (IPEX or native) or the default
        optimizer = self.backend.prepare(method, optimizer)  # may switch the caches off (XLA)
        method.release_text_encoders()  # with the text cache on: embeddings in, encoders out
        self.cache_seconds = method.fill_latent_cache(dataset, accelerator)  # every step then times alike
        self.params = [p for g in optimizer.param_groups for p in g["params"]]  # IPEX may have replaced them
        self.anchor = WeightsAnchor(self.params)  # before any resume: the weights as the method set them up
        lr_scheduler = make_lr_scheduler(cfg, optimizer, self.n_proc)
        dataloader, self.sampler = build_dataloader(dataset, method, cfg)
        prepared = accelerator.prepare(*[modules[n] for n in self.trainable], optimizer, dataloader, lr_scheduler)
        self.wrapped = dict(zip(self.trainable, prepared[: len(self.trainable)]))
        self.optimizer, self.dataloader, self.lr_scheduler = prepared[len(self.trainable):]
        self.live = {**modules, **self.wrapped}
        self.ema = Ema(self.params, cfg) if cfg.use_ema else None
        self.state = TrainState()
        if self.checkpoints is not None:  # saved as safetensors + JSON, never pickled
            self.checkpoints.track({"train": self.state, **({"ema": self.ema} if self.ema is not None else {})})
        register_weight_hooks(accelerator, {n: modules[n] for n in self.trainable})
        if resume_from is not None and self.checkpoints is not None:
            self._resume(resume_from)
        set_training(self.optimizer, True)  # schedule-free: the training point (a checkpoint holds it)
        self.pending = _Step()
        self.snapshot = RngSnapshot.take(accelerator)

    def _resume(self, resume_from: Path) -> None:
        self.checkpoints.load(resume_from)
        self.resumed_from = self.state.step
        if self.judge is not None:
            _protect_best(self.checkpoints, self.judge, self.state)
        if self.state.step > self.cfg.max_train_steps:
            log.warning("the checkpoint is at step %d, past train.max_train_steps %d: its weights are the output",
                        self.state.step, self.cfg.max_train_steps)

    def log_start(self) -> None:
        cfg = self.cfg
        log.info("training %s (%s, %.2fM trainable parameters) for %d steps%s, batch %d x %d accumulation x %d "
                 "processes, precision %s on %s; SIGTERM/SIGINT save a checkpoint", self.method.name,
                 ", ".join(self.trainable), sum(p.numel() for p in self.params) / 1e6, cfg.max_train_steps,
                 f" from step {self.resumed_from}" if self.resumed_from is not None else "", cfg.train_batch_size,
                 cfg.gradient_accumulation_steps, self.n_proc, cfg.mixed_precision, self.accelerator.device)

    def train(self, stop: StopFlag, bar: Any) -> None:
        """Epochs until max_train_steps; a resumed run skips the batches its epoch had already used."""
        from accelerate import skip_first_batches

        state = self.state
        while state.step < self.cfg.max_train_steps:
            skip = state.batches_in_epoch
            loader = skip_first_batches(self.dataloader, skip) if skip else self.dataloader
            loader.set_epoch(state.epoch)
            self.sampler.set_epoch(state.epoch)
            if not self._epoch(loader, skip, stop, bar):
                state.epoch, state.batches_in_epoch = state.epoch + 1, 0

    def _epoch(self, loader: Any, consumed: int, stop: StopFlag, bar: Any) -> bool:
        """One pass over the loader; True when it ended at max_train_steps rather than the epoch's end."""
        fetch = time.perf_counter()
        for batch in self.backend.loader(loader):
            self.pending.data_seconds += time.perf_counter() - fetch
            consumed += 1
            self._micro_step(batch)
            if self.accelerator.sync_gradients:
                self._end_of_step(consumed, stop, bar)
                self.pending = _Step()
                if self.state.step >= self.cfg.max_train_steps:
                    return True
            fetch = time.perf_counter()
        return False

    def _micro_step(self, batch: Any) -> None:
        """Forward and backward of one batch; the optimizer steps when accumulation is complete."""
        accelerator, step = self.accelerator, self.pending
        with accelerator.accumulate(*self.wrapped.values()):
            with accelerator.autocast():
                loss, parts = self.method.compute_loss(batch, self.live)
            self.lr = self.lr_scheduler.get_last_lr()[0]
            accelerator.backward(loss)
            self.backend.after_backward()  # XLA: forward and backward run here, as one graph
            _check_finite(float(loss.detach()), "loss", self.state.step + 1, self.lr, self.checkpoints)
            step.grad_norm = float("nan")
            if accelerator.sync_gradients:
                step.grad_norm = float(accelerator.clip_grad_norm_(self.params, self.cfg.max_grad_norm))
                if accelerator.mixed_precision != "fp16":  # fp16: the grad scaler skips such steps
                    _check_finite(step.grad_norm, "gradient norm", self.state.step + 1, self.lr, self.checkpoints)
            self.optimizer.step()
            self.lr_scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        step.losses.append(loss.detach())
        for key, value in parts.items():
            step.extras.setdefault(key, []).append(float(value))
        step.images += self.method.images_in(batch) * self.n_proc

    def _end_of_step(self, consumed: int, stop: StopFlag, bar: Any) -> None:
        """The optimizer step is done: advance the state, log it, checkpoint / validate / score, tell the
        callbacks, and stop here when a signal asked to."""
        state, step = self.state, self.pending
        self.method.after_step()
        state.step, state.batches_in_epoch = state.step + 1, consumed
        self.backend.after_step(state.step)
        state.images += step.images
        self.run_images += step.images
        if self.ema is not None:
            self.ema.step(state.step)
        self.snapshot = RngSnapshot.take(self.accelerator)  # the state after this step, whatever follows
        mean_loss = _reduce_step(self.accelerator, step.losses, stop)
        entry = StepLog(state.step, mean_loss, float(self.lr), step.grad_norm, time.perf_counter() - step.start,
                        step.images, step.data_seconds, peak_memory_mb(self.accelerator.device),
                        {k: sum(v) / len(v) for k, v in step.extras.items()})
        state.history.append([state.step, mean_loss, float(self.lr)])
        self._checkpoint_and_validate(entry, mean_loss)
        self.history.append(entry)
        for callback in self.callbacks:
            callback(entry)
        bar.update(1)
        bar.set_postfix(loss=f"{entry.loss:.4f}")
        if stop.requested:
            self._stop(stop)

    def _checkpoint_and_validate(self, entry: StepLog, mean_loss: float) -> None:
        """Validation images every validation_steps, and for each checkpoint the judge scores; a checkpoint
        every checkpointing_steps (and at the end with select_checkpoint: best), healthy weights only."""
        cfg, state, judge, checkpoints = self.cfg, self.state, self.judge, self.checkpoints
        checkpoint_now = checkpoints is not None and (
            state.step % cfg.checkpointing_steps == 0
            or (judge is not None and cfg.select_checkpoint == "best" and state.step >= cfg.max_train_steps))
        if checkpoint_now:
            _check_weights(self.params, state.step, float(self.lr), checkpoints)  # only good ones are saved
        if self.validate is not None and (cfg.validation_steps and state.step % cfg.validation_steps == 0
                                          or checkpoint_now and judge is not None):
            with evaluating(self.optimizer), self.ema.swapped_in() if self.ema is not None else nullcontext():
                entry.validation = self.validate(state.step, self.live)
        if checkpoint_now:
            if judge is not None:  # scored before saving: kept in it
                state.scores.append(_scored_on_main(self.accelerator, judge, state.step, entry, mean_loss))
                _protect_best(checkpoints, judge, state)
            entry.checkpoint = checkpoints.save(state.step)

    def _stop(self, stop: StopFlag) -> None:
        step = self.state.step
        _check_weights(self.params, step, float(self.lr), self.checkpoints)
        saved = _save_unless_saved(self.checkpoints, step)
        raise TrainingInterrupted(
            f"interrupted by {stop.name} after step {step}; "
            + (f"checkpoint saved to {saved}. Run the stage again (train.resume: latest) to continue."
               if saved else "no checkpoint saved (no checkpoint folder)."),
            int(stop.signum or 0),
        )

    def save_on_failure(self) -> None:
        """Any other error: a checkpoint of the last completed step first (its RNG state put back)."""
        checkpoints, step = self.checkpoints, self.state.step
        if checkpoints is None or not step or checkpoints.last_saved == step:
            return
        log.error("training failed after step %d: saving a checkpoint of that step first", step)
        self.snapshot.restore(self.accelerator)
        self.optimizer.zero_grad(set_to_none=True)
        try:
            _check_weights(self.params, step, 0.0, checkpoints)
            _save_unless_saved(checkpoints, step)
        except Exception:  # the original error matters more; say why there is no checkpoint
            log.exception("could not save the checkpoint of step %d", step)

    def finish(self, start: float) -> LoopResult:
        self.accelerator.wait_for_everyone()
        set_training(self.optimizer, False)  # schedule-free: the averaged weights are the output
        trained = {n: self.accelerator.unwrap_model(m) for n, m in self.wrapped.items()}
        self.backend.finish(trained)
        return LoopResult(self.history, self.state, time.perf_counter() - start, self.run_images, trained,
                          self.resumed_from, self.ema, self.params, self.anchor, float(self.lr), self.stopped,
                          self.cache_seconds)


def _reduce_step(accelerator: Any, micro_losses: list[torch.Tensor], stop: StopFlag) -> float:
    """The step's loss averaged over ranks, and the ranks' agreement to stop, in one collective.

    A signal reaches the ranks at slightly different moments: one may see it after step N, another
    only after step N + 1. Stopping on its own flag, a rank would save while the others train on
    and wait for it forever. Every rank stops after the step in which any rank saw a signal.
    """
    mine = torch.stack([torch.stack(micro_losses).mean().float(),
                        torch.tensor(float(stop.signum or 0), device=micro_losses[0].device)])
    every = accelerator.gather(mine.reshape(1, 2)).reshape(-1, 2)
    signum = int(every[:, 1].max())
    if signum and not stop.requested:
        stop.signum = signum  # seen by another rank first
    return float(every[:, 0].mean())


def _scored_on_main(accelerator: Any, judge: CheckpointJudge, step: int, entry: StepLog, loss: float) -> dict:
    """Rank 0 scores the checkpoint (it alone made the validation images); every rank gets the record,
    so every rank keeps the same scores and takes the same decisions (stop on divergence, the best)."""
    from accelerate.utils import broadcast_object_list

    record = [judge.score(step, entry.validation or {}, loss) if accelerator.is_main_process else None]
    if accelerator.num_processes > 1:
        broadcast_object_list(record, from_process=0)
    return record[0]


def _protect_best(checkpoints: CheckpointManager | None, judge: CheckpointJudge, state: TrainState) -> None:
    best = judge.best(state.scores)
    if checkpoints is not None:
        checkpoints.protect(best["step"] if best else None)


def _save_unless_saved(checkpoints: CheckpointManager | None, step: int) -> Path | None:
    if checkpoints is None:
        return None
    if checkpoints.last_saved == step:
        return checkpoints.run_dir / f"checkpoint-{step}"
    return checkpoints.save(step)
