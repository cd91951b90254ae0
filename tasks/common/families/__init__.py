"""Model families: everything family-specific, one module each; every stage reads them here.

    family = families.detect(Path("models/base"))      # from model_index.json
    family.export.ov_pipeline_class(), family.denoiser.objective, family.text.trains_embeddings ...
    family.build_tiny(seed)

Adding a family is adding a module with a `ModelFamily` subclass and listing it in REGISTRY (or
`register(Family, first=True)` from outside; tasks/common/families/README.md says what it must define).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from finetune_runtime.registry import Registry
from tasks.common.errors import UserError
from tasks.common.families.base import Components, ModelFamily, class_images_refusal, refused_options
from tasks.common.families.denoiser import Geometry, PredictInputs
from tasks.common.families.flux import Flux
from tasks.common.families.flux2 import Flux2Klein
from tasks.common.families.kontext import FluxKontext
from tasks.common.families.ltx import LTXVideo
from tasks.common.families.qwenimage import QwenImage
from tasks.common.families.qwenimage_edit import QwenImageEdit
from tasks.common.families.sana import Sana
from tasks.common.families.sd import StableDiffusion
from tasks.common.families.sd3 import StableDiffusion3
from tasks.common.families.sdxl import StableDiffusionXL
from tasks.common.families.zimage import ZImage

#: Every family, in the order detection tries them (the more specific first); `FAMILIES` (a tuple)
#: and `BUILTINS` (`base.model` values of the built-in tiny models -> family) are read from it.
REGISTRY: Registry[type[ModelFamily]] = Registry("model family", (
    StableDiffusionXL, StableDiffusion3, StableDiffusion, Flux, Flux2Klein, ZImage, QwenImage, Sana, FluxKontext,
    QwenImageEdit, LTXVideo))


if TYPE_CHECKING:
    FAMILIES: tuple[type[ModelFamily], ...]
    BUILTINS: dict[str, type[ModelFamily]]


def __getattr__(name: str) -> Any:
    """`FAMILIES` and `BUILTINS`, read from the registry when asked, so they follow register/unregister."""
    if name == "FAMILIES":
        return REGISTRY.items()
    if name == "BUILTINS":
        return {f.builtin: f for f in REGISTRY}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register(family: type[ModelFamily], first: bool = False) -> None:
    """Add a family (a module's ModelFamily subclass) to FAMILIES and its built-in to BUILTINS;
    `first`: detection tries it before the others (a family more specific than one listed)."""
    REGISTRY.register(family, first=first)


def unregister(name: str) -> None:
    """Remove the family called `name` (a test's toy family, once the test is done)."""
    REGISTRY.unregister(name)


def supported() -> str:
    return ", ".join(f"{f.title} ({', '.join(f.pipeline.names)})" for f in REGISTRY)


def denoiser_names() -> tuple[str, ...]:
    """Every family's denoiser folder ("unet", "transformer"), for recognising a folder before its family."""
    return tuple(dict.fromkeys(f.denoiser.name for f in REGISTRY))


def ov_component_names(family: type[ModelFamily]) -> tuple[str, ...]:
    """The compiled models of `family`'s OpenVINO pipeline that run per call: text encoders, denoiser,
    VAE decoder (optimum-intel names them as the diffusers folders, `vae_decoder` aside)."""
    return (*family.text.encoder_names, family.denoiser.name, "vae_decoder")


def by_name(name: str) -> type[ModelFamily]:
    """The family called `name`, or a ValueError naming the known ones."""
    return REGISTRY.get(name)


def from_index(index: dict[str, Any], where: str = "the pipeline") -> type[ModelFamily]:
    """The family a model_index.json belongs to, or a UserError naming the supported ones."""
    for family in REGISTRY:
        if family.pipeline.matches(index):
            return family
    raise UserError(f"{where}: pipeline class {index.get('_class_name')!r} is not supported; "
                    f"supported: {supported()}")


def read_index(path: Path, fix: str = "run the stage that writes it first (dvc repro), or pass a folder "
               "saved with save_pretrained()") -> dict[str, Any]:
    """model_index.json of a diffusers (or exported OpenVINO) pipeline folder, or a UserError that
    ends with `fix` (what to do: the caller knows which stage writes the folder)."""
    index = Path(path) / "model_index.json"
    if not index.is_file():
        raise UserError(f"{path} is not a diffusers pipeline folder (no model_index.json): {fix}")
    return json.loads(index.read_text())


def stored_dtypes(path: Path) -> dict[str, Any]:
    """The torch dtype each component's weights are stored in (from the first floating-point tensor
    of its safetensors files; components without any are left out), e.g. for loading a pipeline in
    the precision it was published in instead of diffusers' default float32."""
    import torch
    from safetensors import safe_open

    names = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    dtypes: dict[str, Any] = {}
    for name, spec in read_index(path).items():
        files = sorted((Path(path) / name).glob("*.safetensors")) if isinstance(spec, list) else []
        if not files:
            continue
        with safe_open(files[0], "pt") as fh:
            found = (fh.get_slice(key).get_dtype() for key in fh.keys())  # noqa: SIM118 (safe_open is not a dict)
            dtype = next((names[d] for d in found if d in names), None)
        if dtype is not None:
            dtypes[name] = dtype
    return dtypes


def detect(path: Path) -> type[ModelFamily]:
    """The family of a diffusers or OpenVINO pipeline folder."""
    return from_index(read_index(path), str(path))


def of_pipeline(pipe: Any) -> type[ModelFamily]:
    """The family of a loaded diffusers or optimum-intel pipeline object."""
    index = {k: list(v) for k, v in pipe.config.items() if isinstance(v, (list, tuple))}
    # a stand-in for a diffusers pipeline (tasks.common.genai.GenAIRunner) names the class it runs
    index["_class_name"] = getattr(pipe, "diffusers_class_name", type(pipe).__name__.removeprefix("OV"))
    return from_index(index, type(pipe).__name__)


def build_tiny_pipeline(kind: str, seed: int, out: Path) -> Path:
    """Build a built-in tiny model (`builtin:tiny-sd`, ...) from `seed` and save it to `out` (safetensors)."""
    builtins = {f.builtin: f for f in REGISTRY}
    if kind not in builtins:
        raise ValueError(f"unknown built-in model {kind!r}; choose one of {', '.join(builtins)}")
    out = Path(out)
    builtins[kind].build_tiny(seed).save_pretrained(out, safe_serialization=True)
    return out


__all__ = ["BUILTINS", "FAMILIES", "REGISTRY", "Components", "Geometry", "ModelFamily", "PredictInputs",
           "StableDiffusion", "StableDiffusionXL", "StableDiffusion3", "Flux", "Flux2Klein", "ZImage", "QwenImage",
           "Sana", "build_tiny_pipeline", "by_name", "class_images_refusal", "denoiser_names", "detect",
           "from_index", "of_pipeline", "ov_component_names", "read_index", "refused_options", "register",
           "stored_dtypes", "supported", "unregister"]
