"""Checkpoints that resume exactly: where they live, what they hold, how they are kept.

Layout: `<checkpoints_dir>/<run key>/checkpoint-<step>/`, outside the stage's DVC outputs (DVC
deletes `models/finetuned` before each run). The run key hashes every setting that changes what
a step computes (see config.NOT_IN_RUN_KEY for those that do not), the base model's files and
the data's metadata, so `resume: latest` only ever continues the same run; a changed learning
rate or dataset starts a new folder instead of silently mixing two runs.

A checkpoint is accelerate's `save_state` (optimizer, LR scheduler, grad scaler, every process's
RNG states, the accumulation counter), the tracked objects (the loop position and loss history,
the EMA weights) as safetensors + JSON, and, through a save hook, only the *trainable* weights of
each trained module as safetensors (all of the UNet for DreamBooth; the adapters for LoRA; the
embedding matrix for textual inversion), then a manifest (run key, sha256 of every file). It is
written to a hidden `.checkpoint-<step>.partial` folder, flushed to disk (files, then the folder),
renamed when complete and the rename flushed too (outputs.publish), so neither a crash nor a power
cut while saving leaves a checkpoint that looks whole; a `.partial` folder a crash left is removed
at the next start. A resume verifies the manifest, hashes included, before any model loads
(`latest` passes over checkpoints that fail, naming them, to the newest that verifies) and never
unpickles more than tensors (checkpoint_files.py).

Pruning, overwriting and removing abandoned `.partial` folders delete only folders directly inside
a run folder that carries the project's marker (tasks/common/safe_remove.py; a checkpoint folder
itself holds only the files its manifest lists). A run folder from before the marker gets it at its
next save.
"""
from __future__ import annotations

import hashlib
import json
import logging
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tasks.common import safe_remove
from tasks.common.errors import UserError
from tasks.common.fingerprint import folder_fingerprint, sha256_file
from tasks.common.outputs import publish, write_json
from tasks.train import checkpoint_files
from tasks.train.config import NOT_IN_RUN_KEY, TrainConfig

log = logging.getLogger(__name__)

PREFIX = "checkpoint-"
RUN_INFO = "run.json"
KIND = "train-checkpoints"  # the marker's kind on each run folder
PARTIAL = re.compile(rf"\.{PREFIX}\d+\.partial")  # a save in progress, or one a crash abandoned


def run_key(
    cfg: TrainConfig, base: Path, data_files: list[Path], num_processes: int = 1
) -> tuple[str, dict[str, Any]]:
    """(16-hex key, what it was computed from). More than one process is part of the key (one rank's
    checkpoint cannot continue on two: batch, data position and RNG files differ)."""
    settings = {k: v for k, v in cfg.model_dump(mode="json").items() if k not in NOT_IN_RUN_KEY}
    if num_processes > 1:
        settings["num_processes"] = num_processes
    info = {
        "settings": settings,
        "base": folder_fingerprint(Path(base)),
        "data": {str(p): sha256_file(p) for p in data_files if p.is_file()},
    }
    digest = hashlib.sha256(json.dumps(info, sort_keys=True).encode()).hexdigest()[:16]
    return digest, info


@dataclass
class TrainState:
    """Where the loop is: optimizer steps done, epoch, batches of that epoch consumed; and the history.

    Registered with accelerate, so it is saved and restored with every checkpoint.
    """

    step: int = 0
    epoch: int = 0
    batches_in_epoch: int = 0
    images: int = 0
    history: list[list[float]] = field(default_factory=list)  # [step, loss, lr] per step
    scores: list[dict[str, Any]] = field(default_factory=list)  # one record per scored checkpoint (selection.py)

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "epoch": self.epoch, "batches_in_epoch": self.batches_in_epoch,
                "images": self.images, "history": [list(h) for h in self.history],
                "scores": [dict(r) for r in self.scores]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.epoch = int(state["step"]), int(state["epoch"])
        self.batches_in_epoch, self.images = int(state["batches_in_epoch"]), int(state["images"])
        self.history = [list(h) for h in state["history"]]
        self.scores = [dict(r) for r in state.get("scores", [])]  # checkpoints written before scoring: none


def trainable_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().contiguous() for n, p in module.named_parameters() if p.requires_grad}


def register_weight_hooks(accelerator: Any, modules: dict[str, torch.nn.Module]) -> None:
    """Make accelerate save and load only the trainable weights, by module name.

    accelerate passes its prepared models in `prepare()` order; we match them to names by identity
    of the unwrapped module, so the files are `trainable_<name>.safetensors` whatever the order.
    """
    from safetensors.torch import load_file, save_file

    names = {id(m): n for n, m in modules.items()}

    def name_of(model: torch.nn.Module) -> str:
        return names[id(accelerator.unwrap_model(model))]

    def save_hook(models: list, weights: list, output_dir: str) -> None:
        if accelerator.is_main_process:
            for model in models:
                state = trainable_state(accelerator.unwrap_model(model))
                save_file(state, str(Path(output_dir) / f"trainable_{name_of(model)}.safetensors"))
        weights.clear()  # accelerate must not save the full state dicts as well

    def load_hook(models: list, input_dir: str) -> None:
        while models:
            model = models.pop()
            path = Path(input_dir) / f"trainable_{name_of(model)}.safetensors"
            if not path.is_file():
                raise UserError(f"{input_dir} holds no {path.name}: it is not a checkpoint of this kind of run "
                                "(set train.resume: none to start over)")
            unwrapped = accelerator.unwrap_model(model)
            expected = set(trainable_state(unwrapped))
            state = load_file(str(path))
            if set(state) != expected:
                raise UserError(f"{path} does not match the model being trained ({len(state)} tensors, "
                                f"{len(expected)} expected): resume from a checkpoint of the same method and base")
            unwrapped.load_state_dict(state, strict=False)

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)


def checkpoint_step(path: Path) -> int | None:
    name = Path(path).name
    if name.startswith(PREFIX) and name[len(PREFIX):].isdigit():
        return int(name[len(PREFIX):])
    return None


class CheckpointManager:
    """Saves, finds, resolves and prunes the checkpoints of one run folder."""

    def __init__(self, run_dir: Path, total_limit: int | None, accelerator: Any, info: dict[str, Any],
                 keep_every: int | None = None) -> None:
        self.run_dir, self.total_limit, self.accelerator, self.info = Path(run_dir), total_limit, accelerator, info
        self.keep_every = keep_every
        self.last_saved: int | None = None
        self.protected: int | None = None  # the best checkpoint's step: never pruned
        self.tracked: dict[str, Any] = {}
        self.verified: Path | None = None  # the checkpoint `resolve` hashed: `load` need not again

    @property
    def key(self) -> str:
        return self.run_dir.name

    def track(self, objects: dict[str, Any]) -> None:
        """Objects with state_dict/load_state_dict saved in every checkpoint (safetensors + JSON, by name)."""
        self.tracked.update(objects)

    def untrack(self) -> None:
        """After training: hold the tracked objects no more (the EMA's shadow weights can go)."""
        self.tracked = {}

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.run_dir.is_dir():
            return []
        found = [p for p in self.run_dir.iterdir() if p.is_dir() and checkpoint_step(p) is not None]
        return sorted(found, key=lambda p: checkpoint_step(p) or 0)

    def resolve(self, resume: str) -> Path | None:
        """The checkpoint `resume` names: none, latest (None when there is none yet), or a folder.

        Verified whole (hashes too) before any model loads. A named checkpoint that fails is refused;
        `latest` takes the newest that verifies, logging each newer one it passes over and why."""
        if resume == "none":
            return None
        if resume == "latest":
            path = self._latest_verified()
        else:
            path = Path(resume)
            if checkpoint_step(path) is None or not path.is_dir():
                raise UserError(f"train.resume: {resume} is not a checkpoint-<step> folder")
            checkpoint_files.verify(path, self.key)
        self.verified = path
        return path

    def _latest_verified(self) -> Path | None:
        found = self.checkpoints()
        if not found:
            log.info("no checkpoint in %s yet: starting from step 0", self.run_dir)
            return None
        skipped: list[tuple[str, str]] = []  # (short, whole) reason per checkpoint passed over
        for path in reversed(found):
            why = checkpoint_files.check(path, self.key)
            if why is None:
                if skipped:
                    log.warning("resuming from %s, the newest checkpoint that verifies; skipped %s", path.name,
                                "; ".join(short for short, _ in skipped))
                return path
            log.warning("skipping checkpoint %s: %s", path, why[0])
            skipped.append((f"{path.name}: {why[0]}", why[1]))
        raise UserError(
            f"no checkpoint in {self.run_dir} verifies, so train.resume: latest has nothing to continue from: "
            f"{'; '.join(whole for _, whole in skipped)}. Nothing in them was read. Set train.resume: none to start "
            f"over (its checkpoints replace these as their steps come round), or move {self.run_dir} away first "
            "to keep them")

    def remove_abandoned(self) -> None:
        """Delete the `.checkpoint-<step>.partial` folders of saves a crash or a kill interrupted (before
        training starts; the main process does it); only in a run folder with the marker, as pruning."""
        if not self.accelerator.is_main_process or not self.run_dir.is_dir():
            return
        for path in sorted(self.run_dir.iterdir()):
            if PARTIAL.fullmatch(path.name) and safe_remove.remove_marked(path, KIND, owner=self.run_dir):
                log.info("removed %s: a checkpoint save that never finished (the process stopped while saving)",
                         path)

    def save(self, step: int) -> Path:
        """Save the whole training state after `step`; returns the checkpoint folder."""
        final = self.run_dir / f"{PREFIX}{step}"
        partial = self.run_dir / f".{PREFIX}{step}.partial"
        acc = self.accelerator
        if acc.is_main_process:
            safe_remove.mark(self.run_dir, KIND)
            write_json(self.run_dir / RUN_INFO, self.info)
            safe_remove.remove_marked(partial, KIND, owner=self.run_dir)
        acc.wait_for_everyone()
        acc.save_state(str(partial))
        acc.wait_for_everyone()
        if acc.is_main_process:
            for name, obj in self.tracked.items():
                checkpoint_files.save_state_dict(obj.state_dict(), partial, name)
            checkpoint_files.write_manifest(partial, self.key, step)
            if final.exists() and not safe_remove.remove_marked(final, KIND, owner=self.run_dir):
                raise UserError(f"{final} exists and is not a checkpoint of this run: move it away")
            publish(partial, final)  # flushed to disk before and after the rename
            self._prune()
        acc.wait_for_everyone()
        self.last_saved = step
        log.info("checkpoint saved: %s", final)
        return final

    def load(self, path: Path) -> None:
        """Verify, then restore: accelerate's states (tensors only), the weights, the tracked objects."""
        from accelerate.utils import load as safe_load

        path = Path(path)
        checkpoint_files.verify(path, self.key, hashes=path != self.verified)  # resolve hashed its choice
        try:
            # accelerate ignores an unreadable RNG file; a resume that is not exact must fail instead
            safe_load(path / f"random_states_{self.accelerator.process_index}.pkl", weights_only=True)
            self.accelerator.load_state(str(path), load_kwargs={"weights_only": True})
            for name, obj in self.tracked.items():
                obj.load_state_dict(checkpoint_files.load_state_dict(path, name))
        except pickle.UnpicklingError as err:
            raise UserError(f"refused to resume from {path}: a state file holds more than tensors ({err}). "
                            "Set train.resume: none to start over") from None
        except (FileNotFoundError, RuntimeError, KeyError) as err:
            raise UserError(f"cannot resume from {path}: {err}. Set train.resume: none to start over") from err
        self.last_saved = checkpoint_step(path)
        log.info("resumed from %s", path)

    def protect(self, step: int | None) -> None:
        """Keep checkpoint `step` (the best so far) out of pruning; the previous one becomes a rolling one."""
        self.protected = step

    def load_weights(self, path: Path, modules: dict[str, torch.nn.Module]) -> None:
        """Put a checkpoint's trained weights (and EMA) into `modules`, leaving the loop's state alone."""
        from safetensors.torch import load_file

        checkpoint_files.verify(Path(path), self.key)
        for name, module in modules.items():
            state = load_file(str(Path(path) / f"trainable_{name}.safetensors"))
            if set(state) != set(trainable_state(module)):
                raise UserError(f"{path} does not hold the trained weights of {name}")
            module.load_state_dict(state, strict=False)
        if "ema" in self.tracked:
            self.tracked["ema"].load_state_dict(checkpoint_files.load_state_dict(Path(path), "ema"))
        log.info("output weights from %s", path)

    def _prune(self) -> None:
        """Keep the newest `total_limit` rolling checkpoints, plus every `keep_every`-th step's for good
        and the protected (best) one."""
        if self.total_limit is None:
            return
        every = (lambda p: (checkpoint_step(p) or 0) % self.keep_every == 0) if self.keep_every else (lambda p: False)
        kept = lambda p: every(p) or checkpoint_step(p) == self.protected  # noqa: E731
        rolling = [p for p in self.checkpoints() if not kept(p)]
        for old in rolling[: max(0, len(rolling) - self.total_limit)]:
            if safe_remove.remove_marked(old, KIND, owner=self.run_dir):
                log.info("removed old checkpoint %s (checkpoints_total_limit %d)", old, self.total_limit)
