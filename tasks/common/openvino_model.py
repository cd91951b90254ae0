"""Loading the exported OpenVINO pipeline (models/openvino/) the same way everywhere.

Used by `evaluate` and by registration/serving: which optimum-intel class fits a folder (its model
family's, from model_index.json), loading it with the static shapes the export stage fixed, and reading
those shapes back from the model itself, so no side file can disagree with the weights.

A statically reshaped pipeline only accepts the exact number of images per call it was reshaped
for (`batch_size` x `num_images_per_prompt`, e.g. that many prompts with one image each), at
`height` x `width`, with classifier-free guidance on (guidance_scale > 1: the UNet batch is
doubled for the unconditional branch).
"""
from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from finetune_runtime.layout import OV_RUNTIME, runtime_config
from tasks.common import families
from tasks.common.errors import UserError

log = logging.getLogger(__name__)

#: The runtime settings the export stage validated and timed the model with (`export.
#: inference_precision`), written beside model_index.json so every loader (the served model's
#: included: finetune_runtime/layout.py `runtime_config`) compiles it alike.
RUNTIME_FILE = OV_RUNTIME

PRECISIONS = ("f32", "bf16", "f16", "auto")

#: What the export stage writes in place of an export when `export.enabled` is false (a model too big
#: to convert on the machine): evaluate then scores the PyTorch fine-tune alone, and the registered
#: version serves it with diffusers.
SKIPPED_FILE = "export_skipped.json"


def write_skipped(path: Path, reason: str) -> None:
    """Record in the export folder that no export was made, and why."""
    (Path(path) / SKIPPED_FILE).write_text(json.dumps({"skipped": True, "reason": reason}, indent=2) + "\n")


def export_or_none(path: Path | None) -> Path | None:
    """`path`, or None where the export stage skipped the export (its SKIPPED_FILE, no model)."""
    if path is not None and (Path(path) / SKIPPED_FILE).is_file() and not is_openvino_folder(path):
        log.info("%s holds no export (export.enabled: false): the PyTorch fine-tune alone is used", path)
        return None
    return path


def precision_config(precision: str) -> dict[str, str]:
    """ov_config for an `export.inference_precision` value ('auto': OpenVINO's own choice)."""
    if precision not in PRECISIONS:
        raise ValueError(f"inference precision must be one of {PRECISIONS}, not {precision!r}")
    return {} if precision == "auto" else {"INFERENCE_PRECISION_HINT": precision}


def write_runtime_config(path: Path, precision: str) -> None:
    """Record in the export folder the precision it is meant to run at."""
    config = {"inference_precision": precision, "ov_config": precision_config(precision)}
    (Path(path) / RUNTIME_FILE).write_text(json.dumps(config, indent=2) + "\n")


def compiled_precisions(pipe: Any) -> dict[str, str]:
    """The precision each compiled model of an OpenVINO pipeline really runs at ('bf16', 'f32')."""
    out = {}
    for name in families.ov_component_names(families.of_pipeline(pipe)):
        part = getattr(pipe, name, None)
        request = getattr(part, "request", None)
        if request is not None:
            out[name] = str(request.get_property("INFERENCE_PRECISION_HINT").get_type_name())
    return out


@dataclass(frozen=True)
class StaticShape:
    """The shape an exported pipeline was fixed to (per call of the pipeline)."""

    batch_size: int
    height: int
    width: int
    num_images_per_prompt: int

    @property
    def images_per_call(self) -> int:
        return self.batch_size * self.num_images_per_prompt

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def is_openvino_folder(path: Path) -> bool:
    """True when the denoiser (UNet or transformer) of `path` is an OpenVINO model."""
    return any((Path(path) / name / "openvino_model.xml").is_file() for name in families.denoiser_names())


def load_ov_pipeline(
    path: Path,
    static: bool = True,
    device: str = "CPU",
    ov_config: dict[str, str] | None = None,
    precision: str | None = None,
) -> Any:
    """Load an exported pipeline; `static=True` keeps the shapes it was saved with (fast path).

    optimum-intel's default (`dynamic_shapes=True`) would undo the export's reshape on load.
    Compiled at `precision` (see PRECISIONS) if given, else with the folder's runtime settings
    (RUNTIME_FILE); `ov_config` adds to or overrides either.
    """
    path = Path(path)
    if not is_openvino_folder(path):
        raise UserError(
            f"{path} is not an exported OpenVINO pipeline (no "
            f"{' or '.join(n + '/openvino_model.xml' for n in families.denoiser_names())}). Run the "
            "export stage first (dvc repro export)"
        )
    cls = families.detect(path).export.ov_pipeline_class()
    base = runtime_config(path) if precision is None else precision_config(precision)
    kind = "static" if static else "dynamic"
    log.info("loading %s from %s (%s shapes)", cls.__name__, path, kind)
    return cls.from_pretrained(
        path,
        dynamic_shapes=not static,
        device=device,
        ov_config={**base, **(ov_config or {})},
    )


def _dim(port: Any, axis: int) -> int:
    d = port.get_partial_shape()[axis]
    return -1 if d.is_dynamic else d.get_length()


def static_shape(pipe: Any) -> StaticShape | None:
    """The call shape a static pipeline accepts; None when the denoiser or VAE is dynamic.

    The denoiser's batch is prompts x images per prompt, doubled where the family runs
    classifier-free guidance in one batch (all but FLUX's guidance-distilled transformer), and only
    that product is fixed (the export leaves the text encoders' batch free), so the shape is
    returned as `images_per_call` prompts with one image each; any split with the same product
    works too. Height and width come from the VAE decoder (latent size x vae_scale_factor).
    """
    family = families.of_pipeline(pipe)
    batch = _dim(getattr(pipe, family.denoiser.name).model.inputs[0], 0)
    height, width = pipe.height, pipe.width
    per_image = 2 if family.denoiser.guidance_in_batch else 1
    if -1 in (batch, height, width) or batch % per_image:
        return None
    return StaticShape(batch // per_image, height, width, 1)


def folder_size_mb(path: Path) -> float:
    """Total size of the files under `path`, in MB (10^6 bytes)."""
    return round(sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()) / 1e6, 3)
