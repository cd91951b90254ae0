"""Loading the exported OpenVINO pipeline (models/openvino/) the same way everywhere.

Used by `evaluate` and by registration/serving: which optimum-intel class fits a folder (SD 1.x or
SDXL, from model_index.json), loading it with the static shapes the export stage fixed, and reading
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

from tasks.common.errors import UserError

log = logging.getLogger(__name__)

#: Compile for fp32 inference unless told otherwise: left to itself, OpenVINO picks a lower
#: precision on some CPUs (measured here: 51 dB PSNR against PyTorch by default, ~100 dB with f32),
#: so results would differ between machines.
DEFAULT_OV_CONFIG = {"INFERENCE_PRECISION_HINT": "f32"}


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


def read_model_index(path: Path) -> dict[str, Any]:
    """model_index.json of a diffusers (or exported OpenVINO) pipeline folder, or a UserError."""
    index = Path(path) / "model_index.json"
    if not index.is_file():
        raise UserError(
            f"{path} is not a pipeline folder (no model_index.json). Run the stage that writes it "
            "first (dvc repro), or pass a folder saved with save_pretrained()"
        )
    return json.loads(index.read_text())


def pipeline_family(path: Path) -> str:
    """'sdxl' for Stable Diffusion XL pipelines, 'sd' for SD 1.x/2.x."""
    index = read_model_index(path)
    name = index.get("_class_name", "")
    if (index.get("text_encoder_2") or [None])[0] is not None or "XL" in name:
        return "sdxl"
    if "StableDiffusion" not in name:
        raise UserError(
            f"{path}: pipeline class {name!r} is not supported; export and evaluation handle "
            "StableDiffusionPipeline (SD 1.x/2.x) and StableDiffusionXLPipeline"
        )
    return "sd"


def ov_pipeline_class(family: str) -> type:
    """optimum-intel's pipeline class for a family ('sd' or 'sdxl')."""
    from optimum.intel import OVStableDiffusionPipeline, OVStableDiffusionXLPipeline

    return OVStableDiffusionXLPipeline if family == "sdxl" else OVStableDiffusionPipeline


def is_openvino_folder(path: Path) -> bool:
    return (Path(path) / "unet" / "openvino_model.xml").is_file()


def load_ov_pipeline(
    path: Path, static: bool = True, device: str = "CPU", ov_config: dict[str, str] | None = None
) -> Any:
    """Load an exported pipeline; `static=True` keeps the shapes it was saved with (fast path).

    optimum-intel's default (`dynamic_shapes=True`) would undo the export's reshape on load.
    """
    path = Path(path)
    if not is_openvino_folder(path):
        raise UserError(
            f"{path} is not an exported OpenVINO pipeline (no unet/openvino_model.xml). Run the "
            "export stage first (dvc repro export)"
        )
    cls = ov_pipeline_class(pipeline_family(path))
    kind = "static" if static else "dynamic"
    log.info("loading %s from %s (%s shapes)", cls.__name__, path, kind)
    return cls.from_pretrained(
        path,
        dynamic_shapes=not static,
        device=device,
        ov_config={**DEFAULT_OV_CONFIG, **(ov_config or {})},
    )


def _dim(port: Any, axis: int) -> int:
    d = port.get_partial_shape()[axis]
    return -1 if d.is_dynamic else d.get_length()


def static_shape(pipe: Any) -> StaticShape | None:
    """The call shape a static pipeline accepts; None when the UNet or VAE is dynamic.

    The UNet's batch is 2 x prompts x images per prompt (classifier-free guidance), and only that
    product is fixed (the export leaves the text encoders' batch free), so the shape is returned
    as `images_per_call` prompts with one image each; any split with the same product works too.
    Height and width come from the VAE decoder (latent size x vae_scale_factor).
    """
    unet_batch = _dim(pipe.unet.model.inputs[0], 0)
    height, width = pipe.height, pipe.width
    if -1 in (unet_batch, height, width) or unet_batch % 2:
        return None
    return StaticShape(unet_batch // 2, height, width, 1)


def folder_size_mb(path: Path) -> float:
    """Total size of the files under `path`, in MB (10^6 bytes)."""
    return round(sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()) / 1e6, 3)
