"""A registered version's artifacts loaded as the pipeline that serves them: the one `load`.

Which backend serves: the OpenVINO export when optimum-intel imports (fast on CPU), compiled at the
precision the export stage validated it at (its openvino_runtime.json), with dynamic shapes and the
size it was exported at as its default; a base export with GenAI's run-time adapters
(genai_serving.py); the diffusers pipeline otherwise, the fine-tune's own or its adapters applied to
its base (a copy in the version, or the one its reference names: base_reference.py).
`FINETUNE_PYFUNC_BACKEND=openvino|diffusers` forces one. Each back end is a `Backend` record in
`BACKENDS` (registry.py); the served model asks its record what it can do, never compares its name.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from finetune_runtime import adapters, base_reference, layout
from finetune_runtime.registry import Registry

log = logging.getLogger("sd_pyfunc")

BACKEND_ENV = "FINETUNE_PYFUNC_BACKEND"


@dataclass(frozen=True)
class Loaded:
    """What serves a version: the pipeline, its backend (`openvino`, `genai`, `diffusers`), the
    folder it came from, and the size an OpenVINO export was saved at (its default; None otherwise)."""

    pipe: Any
    backend: str
    path: str
    exported: tuple[int, int] | None = None


@dataclass(frozen=True)
class Backend:
    """What serves a version, as `Loaded.backend` names it: what it can do beside the pipeline call."""

    name: str
    #: FINETUNE_PYFUNC_BACKEND may name it (GenAI is chosen by the export's contents, not by name)
    forced: bool = False
    #: it applies registered adapters per request (the `adapter` param: GenAI's run-time LoRA),
    #: with classifier-free guidance compiled in
    request_adapters: bool = False
    #: the pipeline of `loaded`'s model that starts a clip from an image, named by class (None: it cannot)
    first_frame: Callable[[Loaded, str], Any] | None = None


def want_openvino() -> bool:
    """Whether the OpenVINO export serves (FINETUNE_PYFUNC_BACKEND, else whether optimum-intel imports)."""
    choice = os.environ.get(BACKEND_ENV, "auto").lower()
    forced = [b.name for b in BACKENDS if b.forced]
    if choice != "auto" and choice not in forced:
        raise ValueError(f"{BACKEND_ENV} must be auto, {', '.join(forced[:-1])} or {forced[-1]}, not {choice!r}")
    if choice != "auto":
        return choice == OPENVINO.name
    try:
        import optimum.intel  # noqa: F401
    except ImportError:
        return False
    return True


def openvino_pipeline(path: str, class_name: str | None = None) -> tuple[Any, tuple[int, int] | None]:
    """(the export with dynamic shapes, the (height, width) it was exported at; None if dynamic).

    Served dynamic, so an edit is made at its input image's size; the exported size is the default,
    which optimum-intel's dynamic load forgets (a 256 px FLUX.2 export would make 1024 px images,
    the denoiser's sample size, at 16x the cost). Read from the saved shapes, then made dynamic.
    `class_name`: optimum-intel's pipeline class to load the folder as (default: the one it names)."""
    import optimum.intel

    cls = getattr(optimum.intel, class_name or "OVDiffusionPipeline")
    pipe = cls.from_pretrained(path, ov_config=layout.runtime_config(path), dynamic_shapes=False, compile=False)
    height, width = pipe.height, pipe.width
    pipe.reshape(batch_size=-1, height=-1, width=-1, num_images_per_prompt=-1)
    pipe.compile()
    return pipe, ((height, width) if height > 0 and width > 0 else None)


def first_frame_pipeline(loaded: Loaded, class_name: str) -> Any:
    """The pipeline of `loaded`'s model that starts a clip from its first frame (the call convention's
    `first_frame_pipeline`): diffusers' on the same modules, or optimum-intel's "OV" one on the same export."""
    make = BACKENDS.get(loaded.backend).first_frame if loaded.backend in BACKENDS else None
    if make is None:
        raise ValueError(f"the {loaded.backend} back end cannot start a clip from an image")
    return make(loaded, class_name)


def _openvino_first_frame(loaded: Loaded, class_name: str) -> Any:
    return openvino_pipeline(loaded.path, f"OV{class_name}")[0]


def _diffusers_first_frame(loaded: Loaded, class_name: str) -> Any:
    import diffusers

    return getattr(diffusers, class_name).from_pipe(loaded.pipe)


OPENVINO = Backend("openvino", forced=True, first_frame=_openvino_first_frame)
GENAI = Backend("genai", request_adapters=True)
DIFFUSERS = Backend("diffusers", forced=True, first_frame=_diffusers_first_frame)
#: every serving back end, in the order load() tries them (registry.py: the project's one registry style)
BACKENDS: Registry[Backend] = Registry("serving back end", (GENAI, OPENVINO, DIFFUSERS))


def diffusers_pipeline(artifacts: dict[str, str], precision: dict[str, str] | None = None) -> Any:
    """The fine-tuned pipeline: the version's own, or its adapters (adapters.py) applied to its base,
    a copy in the version or the one its reference names, loaded in the precision it trained in."""
    from diffusers import DiffusionPipeline

    path = artifacts[layout.FINETUNED]
    if layout.is_pipeline(path):
        return DiffusionPipeline.from_pretrained(path)
    if layout.BASE in artifacts:
        base, kwargs = artifacts[layout.BASE], {}
    elif layout.BASE_REFERENCE in artifacts:  # a big base, registered by reference
        base, kwargs = base_reference.resolve(artifacts[layout.BASE_REFERENCE])
        kwargs.update(base_reference.quantization(precision))  # as it trained: a big base fits
    else:
        raise ValueError(f"{path} holds no pipeline ({layout.MODEL_INDEX}) and the model has no base")
    contents = layout.contents(path)
    if contents.lora is None:  # serving the bare base as the fine-tune would hide a broken version
        raise ValueError(f"{path} holds neither a pipeline ({layout.MODEL_INDEX}) nor adapters "
                         f"({layout.LORA_WEIGHTS}, {layout.PEFT_DIR}/)")
    pipe = DiffusionPipeline.from_pretrained(base, **kwargs)
    adapters.apply(pipe, contents, merge_peft=True)
    return pipe


def load(artifacts: dict[str, str], model_config: dict[str, Any] | None, cache_mb: float) -> Loaded:
    """The pipeline that serves a version's `artifacts` (see the module's docstring); `cache_mb`: the
    downloaded adapters a base export's endpoint keeps."""
    artifacts, own = dict(artifacts), None
    if layout.ADAPTER in artifacts and layout.OPENVINO not in artifacts:  # a run-time adapter version:
        from finetune_runtime import genai_serving  # its base's export and pipeline

        export, pipeline, own = genai_serving.base_export_of(artifacts[layout.ADAPTER])
        artifacts.update({layout.OPENVINO: export, layout.BASE: pipeline})
    path = artifacts.get(layout.OPENVINO)
    if path and want_openvino() and os.path.isfile(os.path.join(path, layout.GENAI_BASE)):
        from finetune_runtime import adapter_cache, genai_serving

        allowed = adapter_cache.allowed_models(model_config)  # the models whose versions it applies
        return Loaded(genai_serving.AdapterServer(path, layout.runtime_config(path), cache_mb, own=own,
                                                  allowed=allowed), GENAI.name, path)
    if path and want_openvino():
        pipe, exported = openvino_pipeline(path)
        return Loaded(pipe, OPENVINO.name, path, exported)
    precision = (model_config or {}).get("base_precision")
    return Loaded(diffusers_pipeline(artifacts, precision), DIFFUSERS.name, artifacts[layout.FINETUNED])
