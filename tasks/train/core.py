"""Train: load the base, check the data, run the shared loop with the configured method, save.

No MLflow here: the CLI passes callbacks that log. `train()` returns everything the report needs.
"""
from __future__ import annotations

import csv
import logging
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch.utils.data import DataLoader

from tasks.common.errors import UserError
from tasks.common.fingerprint import weight_hashes
from tasks.common.outputs import atomic_dir, atomic_file
from tasks.train.config import TrainConfig
from tasks.train.loop import Callback, StepLog, make_accelerator, run_loop
from tasks.train.methods import METHODS
from tasks.train.models import load_components
from tasks.train.validation import validation_images

log = logging.getLogger(__name__)


@dataclass
class TrainOutcome:
    method: str
    family: str
    history: list[StepLog]
    seconds: float  # the loop only
    total_seconds: float  # loading + loop + saving + validation
    images: int
    weights: dict[str, str]
    validation: list[Image.Image]

    def report(self) -> dict[str, Any]:
        """reports/train.json (DVC metrics)."""
        last = self.history[-1]
        tail = [h.loss for h in self.history[-10:]]
        return {
            "method": self.method,
            "family": self.family,
            "steps": last.step,
            "final_loss": last.loss,
            "mean_loss_last_10": sum(tail) / len(tail),
            "seconds": round(self.seconds, 3),
            "total_seconds": round(self.total_seconds, 3),
            "median_step_seconds": round(statistics.median(h.seconds for h in self.history), 4),
            "images_per_second": round(self.images / self.seconds, 3) if self.seconds > 0 else 0.0,
            "weights_sha256": self.weights,
        }


def build_dataloader(dataset: Any, collate: Any, cfg: TrainConfig) -> DataLoader:
    """Shuffled by a generator seeded from `cfg.seed`: the same order on every run."""
    return DataLoader(
        dataset,
        batch_size=cfg.train_batch_size,
        shuffle=True,
        collate_fn=collate,
        num_workers=cfg.dataloader_num_workers,
        generator=torch.Generator().manual_seed(cfg.seed),
    )


def train(
    cfg: TrainConfig,
    base: Path,
    data_dir: Path,
    class_dir: Path | None,
    out_dir: Path,
    callbacks: list[Callback] = (),  # type: ignore[assignment]
) -> TrainOutcome:
    """Fine-tune `base` on `data_dir` (+ `class_dir`) and write a pipeline folder to `out_dir`.

    `out_dir` appears only complete: it is written to a temporary sibling, loaded back for the
    validation images, and moved into place last.
    """
    import time

    from accelerate.utils import set_seed

    start = time.perf_counter()
    base = Path(base)
    if not (base / "model_index.json").is_file():
        raise UserError(f"{base} is not a diffusers pipeline folder: run the `base` stage first (dvc repro base)")
    accelerator = make_accelerator(cfg)
    set_seed(cfg.seed)
    method = METHODS[cfg.method](cfg)
    dataset = method.dataset(Path(data_dir), Path(class_dir) if class_dir else None)  # fails fast on bad data
    components = load_components(base, cfg.prediction_type)
    method.bind(components)
    dataloader = build_dataloader(dataset, method.collate, cfg)
    result = run_loop(method, dataloader, cfg, accelerator, callbacks)
    images: list[Image.Image] = []
    weights: dict[str, str] = {}
    if accelerator.is_main_process:
        with atomic_dir(out_dir) as tmp:
            method.save(base, tmp, result.trained)
            images = validation_images(
                tmp, cfg.validation_prompt or cfg.instance_prompt, cfg.num_validation_images,
                cfg.resolution, cfg.validation_inference_steps, cfg.seed,
            )
        weights = weight_hashes(Path(out_dir))
    accelerator.wait_for_everyone()
    return TrainOutcome(
        method=cfg.method, family=components.family, history=result.history, seconds=result.seconds,
        total_seconds=time.perf_counter() - start, images=result.images, weights=weights, validation=images,
    )


def write_loss_csv(path: Path, history: list[StepLog]) -> None:
    """step,loss,lr per optimizer step: the DVC plot of the loss curve."""
    with atomic_file(path) as tmp:
        with open(tmp, "w", newline="", encoding="utf-8") as fh:
            writer = csv.writer(fh)
            writer.writerow(["step", "loss", "lr"])
            for h in history:
                writer.writerow([h.step, f"{h.loss:.6g}", f"{h.lr:.6g}"])
