"""What a version's own run shows: its scores, its images and what trained it, in one place.

The run a version is created from (the flow's parent run, or the register CLI's own run) is the one
the registry links from the version's page and reads in its compare view. Registration writes into
it, before the version exists:

- the evaluation's metrics as MLflow metrics (`clip_t`, `clip_i`, `dino`, `gain_dino`, ...,
  `gate.passed` 1/0), linked to the logged model, so the registry's compare view and the logged
  model's page list them;
- the images, under `story/`: the evaluate stage's grids (`grid.png` the fine-tune's, `grid_base.png`,
  `grid_export.png`, `grid_edits.png`, a video model's `preview.gif`, those it wrote), `loss.png`, the
  loss curve drawn from the train stage's `train_loss.csv`, and `validation_grid.png`, the train
  stage's validation images, copied from its run when it ran as a child of the version's run (the
  flow's; a train stage DVC skipped made none in this run);
- tags: `family`, `task`, `method`, `adapter` (the LoRA type, `embedding`, or `none (full weights)`),
  `steps`, `data` (the md5 of data/processed) and `cpu` (lscpu's model name and the vector units
  that set the speed: `Intel(R) Xeon(R) Processor (avx512f, avx512_bf16, amx_tile)`).

The version's description ends with the fine-tune's grid (markdown, an image the tracking server
serves from the run), so its page shows the scores and the images without a click.
"""
from __future__ import annotations

import csv
import logging
import os
import shutil
import subprocess
import time
import urllib.parse
from pathlib import Path
from typing import Any

from finetune_runtime import layout
from tasks.register.lineage import Evaluation
from tasks.register.naming import Lineage

log = logging.getLogger(__name__)

#: Where the images go in the version's run.
FOLDER = "story"
#: The evaluate stage's grids (tasks/evaluate/__main__.py write_plots), in the order they are shown, and a
#: video model's preview of its first clip.
GRIDS = ("grid.png", "grid_base.png", "grid_export.png", "grid_edits.png", "preview.gif")
LOSS = "loss.png"
#: The train stage's validation images, one grid (tasks/train/stage.py logs it into its run).
VALIDATION = "validation_grid.png"
#: lscpu flags that say which vector units a CPU has (the speed of training and serving turns on them).
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve")


def cpu_kind() -> str:
    """lscpu's model name and the vector-unit flags it lists: `Intel(R) Xeon(R) Processor (avx2,
    avx512f, amx_tile)`; the platform's machine name when lscpu is missing."""
    import platform

    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10,
                              env={**os.environ, "LC_ALL": "C"}).stdout
    except (OSError, subprocess.SubprocessError):
        text = ""
    fields = {key.strip(): value.strip() for key, _, value in (line.partition(":") for line in text.splitlines())}
    model = fields.get("Model name") or platform.machine() or "unknown CPU"
    flags = set(fields.get("Flags", "").split())
    units = [flag for flag in CPU_FLAGS if flag in flags]
    return f"{model} ({', '.join(units)})" if units else model


def adapter_type(trained: dict[str, Any] | None, finetuned: Path) -> str:
    """What the fine-tune adds to its base: the LoRA type, an embedding, or full weights (from what
    the train output holds: finetune_runtime/layout.py)."""
    if trained and trained.get("lora_type"):
        return str(trained["lora_type"])
    held = layout.contents(finetuned)
    if held.full_pipeline:
        return "none (full weights)"
    return "embedding" if held.embeds is not None else "unknown"


def run_tags(lineage: Lineage, trained: dict[str, Any] | None, finetuned: Path, steps: Any, data: str | None
             ) -> dict[str, str]:
    """The version's run's tags: family, task, method, adapter type, steps, data hash, CPU kind."""
    return {"family": lineage.family or "unknown", "task": lineage.task or "unknown",
            "method": lineage.method or "unknown", "adapter": adapter_type(trained, finetuned),
            "steps": str(steps if steps is not None else "unknown"), "data": data or "unknown",
            "cpu": cpu_kind()}


def loss_curve(table: Path, out: Path) -> Path | None:
    """`out`: the loss per step of the train stage's `step,loss,lr` table; None when it has no rows."""
    steps, losses = [], []
    with open(table, newline="", encoding="utf-8") as fh:
        for row in csv.DictReader(fh):
            try:
                steps.append(int(float(row["step"])))
                losses.append(float(row["loss"]))
            except (KeyError, TypeError, ValueError):
                continue
    if not steps:
        return None
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 3.2), dpi=100)
    ax = fig.add_subplot()
    ax.plot(steps, losses, marker="o" if len(steps) <= 30 else None, linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("training loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out)
    return out


def images(grids: Path | None, loss_table: Path | None, work: Path) -> dict[str, Path]:
    """{name in `story/`: file} of the grids the evaluate stage wrote into `grids` and the loss
    curve drawn into `work` from `loss_table`; those missing are left out (and logged)."""
    found = {name: Path(grids) / name for name in GRIDS if grids is not None and (Path(grids) / name).is_file()}
    if loss_table is not None and Path(loss_table).is_file():
        drawn = loss_curve(Path(loss_table), Path(work) / LOSS)
        if drawn is not None:
            found[LOSS] = drawn
    if "grid.png" not in found:
        log.info("no evaluation grid in %s: the version's run shows its scores without images", grids)
    return found


def log_story(client: Any, run_id: str, evaluation: Evaluation, shown: dict[str, Path], tags: dict[str, str],
              model_id: str | None = None) -> None:
    """Write the metrics (linked to the logged model `model_id`), the images and the tags into the
    version's run `run_id`."""
    from mlflow.entities import Metric, RunTag

    now = int(time.time() * 1000)
    values = {**evaluation.metrics, "gate.passed": float(evaluation.passed)}
    metrics = [Metric(key, float(value), now, 0, model_id=model_id) for key, value in sorted(values.items())]
    for i in range(0, len(metrics), 1000):  # MLflow's batch limit
        client.log_batch(run_id, metrics=metrics[i:i + 1000])
    client.log_batch(run_id, tags=[RunTag(k, v[:5000]) for k, v in tags.items()])
    import tempfile

    with tempfile.TemporaryDirectory(prefix="story-") as tmp:
        for name, path in shown.items():
            shutil.copyfile(path, Path(tmp) / name)
        validation = _validation_grid(client, run_id, Path(tmp))
        if shown or validation:
            client.log_artifacts(run_id, tmp, FOLDER)


def _validation_grid(client: Any, run_id: str, work: Path) -> bool:
    """Copy the train stage's `validation_grid.png` into `work` from the newest train run that is a
    child of `run_id` (tasks/common/tracking.py stage_run tags it); False when there is none."""
    experiment = client.get_run(run_id).info.experiment_id
    children = client.search_runs([experiment], max_results=1, order_by=["attributes.start_time DESC"],
                                  filter_string=f"tags.mlflow.parentRunId = '{run_id}' and tags.stage = 'train'")
    if not children or VALIDATION not in {f.path for f in client.list_artifacts(children[0].info.run_id)}:
        return False
    client.download_artifacts(children[0].info.run_id, VALIDATION, str(work))
    return True


def markdown(run_id: str, shown: dict[str, Path]) -> str:
    """The description's images: the fine-tune's grid (and the edits' grid), as the tracking
    server serves them from the run; '' without them."""
    parts = []
    for name, title in (("grid.png", "the fine-tune's evaluation grid"), ("grid_edits.png", "its edits")):
        if name in shown:
            query = urllib.parse.urlencode({"path": f"{FOLDER}/{name}", "run_uuid": run_id})
            parts.append(f"![{title}](get-artifact?{query})")
    return ("\n\n" + " ".join(parts) + f"\n\nImages, scores and the loss curve: run {run_id}, `{FOLDER}/`.") \
        if parts else ""
