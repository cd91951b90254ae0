"""The registered model's code: an MLflow pyfunc that turns prompts into images.

Logged as "models from code" (MLflow copies this file into the model), so it must stand alone:
it imports nothing from this repository. Its two artifacts are the fine-tuned diffusers pipeline
(`finetuned`) and its OpenVINO export (`openvino`). It runs the OpenVINO export when optimum-intel
imports (fast on CPU), compiled at the precision the export stage validated it at (its
`openvino_runtime.json`) with dynamic shapes and the size it was exported at as the default
height and width, and the diffusers pipeline otherwise; `FINETUNE_PYFUNC_BACKEND=openvino|
diffusers` forces one.

Input: a list of prompts, or a DataFrame with a `prompt` column. Params (all optional): `seed`,
`num_inference_steps`, `guidance_scale`, `height`, `width`, `num_images_per_prompt`, for a
base export's endpoint `adapter`, and for a model that edits (model_config `input_images`) `image`,
the input images as a list of base64 files (serving_images.py). serving_limits.py (logged beside
this file, MLflow `code_paths`) holds their types, defaults and ranges, refuses anything outside
them with HTTP 400, and bounds a request's cost, queue and time. Output: a DataFrame with `prompt`, `seed` and
`image` (a base64-encoded PNG), one row per image, which `mlflow models serve` returns as JSON.
Image k of the request (prompt by prompt, then image by image) is generated with seed `seed + k`,
one image per pipeline call, so results do not depend on the batch and static-shape OpenVINO
exports (batch 1) accept any number of prompts.
"""
from __future__ import annotations

import base64
import io
import json
import logging
import os
import time
from typing import Any

import mlflow
import pandas as pd

try:  # logged beside this file as the model's code (MLflow `code_paths`)
    import base_reference
    import pipeline_call
    import serving_limits as limits
except ImportError:  # this file imported from the repository (tests, the register stage)
    from tasks.common import pipeline_call
    from tasks.register import base_reference
    from tasks.register import serving_limits as limits

log = logging.getLogger("sd_pyfunc")

BACKEND_ENV = "FINETUNE_PYFUNC_BACKEND"


def _sample_size(module: Any) -> Any:
    config = getattr(module, "config", None) or {}
    return config.get("sample_size") if isinstance(config, dict) else getattr(config, "sample_size", None)


def model_size(pipe: Any, convention: dict[str, Any] | None = None) -> tuple[tuple[int, int], bool]:
    """((height, width) the pipeline makes by default, whether that is the only size it makes).

    A static-shape OpenVINO export has its shape (and ignores a requested one); otherwise the
    denoiser's sample size (`default_sample_size` for SDXL, SD3, FLUX; the family's, recorded in
    its call `convention`, where the pipeline hard-codes it) times the VAE scale factor; 512 px
    when none is known."""
    height, width = getattr(pipe, "height", -1), getattr(pipe, "width", -1)
    if isinstance(height, int) and isinstance(width, int) and height > 0 and width > 0:
        return (height, width), True
    sample = getattr(pipe, "default_sample_size", None) or (convention or {}).get("default_sample_size")
    if sample is None:  # the denoiser: the one component besides the VAE whose config has a sample size
        components = getattr(pipe, "components", None) or {}
        sizes = [_sample_size(module) for name, module in components.items() if name != "vae"]
        sample = next((size for size in sizes if size is not None), None)
    if isinstance(sample, (list, tuple)):
        sample = sample[0]
    if not isinstance(sample, int) or sample <= 0:
        return (512, 512), False
    size = sample * int(getattr(pipe, "vae_scale_factor", 8))
    return (size, size), False


def to_png_base64(image: Any) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _want_openvino() -> bool:
    choice = os.environ.get(BACKEND_ENV, "auto").lower()
    if choice not in ("auto", "openvino", "diffusers"):
        raise ValueError(f"{BACKEND_ENV} must be auto, openvino or diffusers, not {choice!r}")
    if choice != "auto":
        return choice == "openvino"
    try:
        import optimum.intel  # noqa: F401
    except ImportError:
        return False
    return True


def _runtime_config(path: str) -> dict[str, str]:
    """The OpenVINO settings the export stage validated (openvino_runtime.json); fp32 without it.

    Read here rather than imported: this file is the model's code and must load on its own.
    """
    file = os.path.join(path, "openvino_runtime.json")
    if not os.path.isfile(file):
        return {"INFERENCE_PRECISION_HINT": "f32"}
    with open(file) as fh:
        return dict(json.load(fh)["ov_config"])


def _openvino_pipeline(path: str) -> tuple[Any, tuple[int, int] | None]:
    """(the export with dynamic shapes, the (height, width) it was exported at; None if dynamic).

    Served dynamic, so an edit is made at its input image's size; the exported size is the default,
    which optimum-intel's dynamic load forgets (a 256 px FLUX.2 export would make 1024 px images,
    the denoiser's sample size, at 16x the cost). Read from the saved shapes, then made dynamic."""
    from optimum.intel import OVDiffusionPipeline

    pipe = OVDiffusionPipeline.from_pretrained(path, ov_config=_runtime_config(path), dynamic_shapes=False,
                                               compile=False)
    height, width = pipe.height, pipe.width
    pipe.reshape(batch_size=-1, height=-1, width=-1, num_images_per_prompt=-1)
    pipe.compile()
    return pipe, ((height, width) if height > 0 and width > 0 else None)


def _genai_serving() -> Any:
    """genai_serving.py: logged beside this file as the model's code, or the repository's."""
    try:
        import genai_serving
    except ImportError:  # this file imported from the repository (tests)
        from tasks.register import genai_serving
    return genai_serving


def _diffusers_pipeline(artifacts: dict[str, str], precision: dict[str, str] | None = None) -> Any:
    """The fine-tuned pipeline; adapters registered unfused are loaded onto their base (LoRA and
    DoRA with diffusers' loader, LoKr and LoHa fused through peft's), a copy in the version or the
    one its reference names (base_reference.py)."""
    from diffusers import DiffusionPipeline

    path = artifacts["finetuned"]
    if os.path.isfile(os.path.join(path, "model_index.json")):
        return DiffusionPipeline.from_pretrained(path)
    if "base" in artifacts:
        base, kwargs = artifacts["base"], {}
    elif base_reference.ARTIFACT in artifacts:  # a big base, registered by reference
        base, kwargs = base_reference.resolve(artifacts[base_reference.ARTIFACT])
        kwargs.update(base_reference.quantization(precision))  # as it trained: a big base fits
    else:
        raise ValueError(f"{path} holds no pipeline (model_index.json) and the model has no base")
    pipe = DiffusionPipeline.from_pretrained(base, **kwargs)
    peft_dir = os.path.join(path, "peft_adapters")
    if not os.path.isdir(peft_dir):
        pipe.load_lora_weights(path, weight_name="pytorch_lora_weights.safetensors")
        return pipe
    from peft import PeftModel  # LoKr/LoHa, which diffusers' LoRA loader does not read: peft's own

    for name in sorted(os.listdir(peft_dir)):
        setattr(pipe, name, PeftModel.from_pretrained(getattr(pipe, name), os.path.join(peft_dir, name))
                .merge_and_unload())
    return pipe


class DiffusionImageModel(mlflow.pyfunc.PythonModel):
    """Prompts in, base64 PNGs out; the pipeline is loaded once per process."""

    def load_context(self, context: Any) -> None:
        artifacts, own = dict(context.artifacts), None
        if "adapter" in artifacts and "openvino" not in artifacts:  # a run-time adapter version:
            export, pipeline, own = _genai_serving().base_export_of(artifacts["adapter"])  # its base's
            artifacts.update(openvino=export, base=pipeline)
        path, model_config = artifacts.get("openvino"), getattr(context, "model_config", None)
        exported = None  # the size an OpenVINO export was made at, its default
        if path and _want_openvino() and os.path.isfile(os.path.join(path, "genai_base.json")):
            cache_mb = limits.serving_config(model_config)["adapter_cache_mb"]
            pipe, backend = _genai_serving().AdapterServer(path, _runtime_config(path), cache_mb, own=own), "genai"
        elif path and _want_openvino():
            (pipe, exported), backend = _openvino_pipeline(path), "openvino"
        else:
            path = artifacts["finetuned"]
            pipe, backend = _diffusers_pipeline(artifacts, (model_config or {}).get("base_precision")), "diffusers"
        self.serve(pipe, backend, model_config, exported)
        log.info("loaded the %s pipeline from %s; a request may cost %s pixel-steps (%g images of %dx%d px "
                 "at %d steps), %d may wait, timeout %s s", backend, path, self.budget.pixel_steps,
                 self.budget.images, self.budget.height, self.budget.width, self.budget.steps,
                 self.turns.max_waiting, self.timeout_s)

    def serve(self, pipe: Any, backend: str, model_config: dict[str, Any] | None,
              default_size: tuple[int, int] | None = None) -> None:
        """Serve `pipe` with the limits of `model_config` (SERVING_DEFAULTS where it says nothing);
        `default_size`: the (height, width) a request that asks for none gets (an export's own size)."""
        config = limits.serving_config(model_config)
        # the family's call convention (ModelFamily.call_convention), recorded at registration
        self.convention = dict((model_config or {}).get("pipeline_call") or {})
        self.input_images = int((model_config or {}).get("input_images") or 0)  # an edit's, at most
        self.pipe, self.backend = pipe, backend
        self.pipe.set_progress_bar_config(disable=True)
        (height, width), static = model_size(pipe, self.convention)
        self.default_size = default_size if default_size and not static else None
        height, width = self.default_size or (height, width)
        self.budget = limits.Budget(config["budget_images"], height, width)
        self.size = (height, width) if static else None  # a static export makes this size only
        # `mlflow models serve` runs each request in a thread of its worker: a pipeline (its
        # scheduler's step state, OpenVINO's infer requests) must not run two calls at once.
        self.turns = limits.Turns(config["max_waiting"])
        self.timeout_s = limits.request_timeout()

    # `pd.DataFrame` is one of the hints MLflow infers no schema from (it warns on a missing hint
    # and would replace a list hint's schema for check_request's): requests (a list or a frame of
    # prompts) are checked by serving_limits.check_request, typed and bounded, 400 naming the field.
    def predict(self, context, model_input: pd.DataFrame, params=None):
        """One row per image; see the module docstring for inputs, params and output."""
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        multiple = int(getattr(self.pipe, "vae_scale_factor", 8))
        prompts, settings = limits.check_request(model_input, params, multiple, self.budget, self.size,
                                                 self.input_images)
        if self.default_size and not settings["image"]:  # an edit without a size: its input image's
            settings["height"] = settings["height"] or self.default_size[0]
            settings["width"] = settings["width"] or self.default_size[1]
        spec = self._adapter_spec(settings.pop(limits.ADAPTER_PARAM), settings)
        seed, per_prompt = settings["seed"], settings["num_images_per_prompt"]
        rows: list[dict[str, Any]] = []
        # adapters are looked up, downloaded and compiled in the model's turn, under the deadline
        with self.turns.turn(deadline):
            try:
                settings["adapters"] = self._adapters(spec, deadline)
                for k in range(len(prompts) * per_prompt):
                    rows.append(self._generate(prompts[k // per_prompt], seed + k, settings, deadline))
            except limits.PastDeadline as stop:
                log.warning("stopped a request at image %d of %d, %s: past its %g s (%s)", len(rows) + 1,
                            len(prompts) * per_prompt, stop, self.timeout_s, limits.TIMEOUT_ENV)
                raise limits.timed_out(
                    f"stopped after {self.timeout_s:g} s ({limits.TIMEOUT_ENV}), at image {len(rows) + 1} of "
                    f"{len(prompts) * per_prompt}, {stop}: lower the cost or raise the server's --timeout") from None
        return pd.DataFrame(rows, columns=["prompt", "seed", "image"])

    def _adapter_spec(self, spec: str, settings: dict[str, Any]) -> str | None:
        """The `adapter` param checked before the queue (no look-up): None where the endpoint
        applies no adapter or its own; a bad_request names the field."""
        if self.backend == "genai" and settings["guidance_scale"] <= 1:
            raise limits.bad_request(f"guidance_scale: {settings['guidance_scale']:g}; this base export is compiled "
                              "with classifier-free guidance: allowed above 1")
        if self.backend != "genai" or self.pipe.own is not None:
            if spec:
                raise limits.bad_request(f"{limits.ADAPTER_PARAM}: this endpoint serves one fine-tune; adapters are "
                                  "applied by the endpoint of their registered base export (<model>-base)")
            return None
        try:
            _genai_serving().parse_adapters(spec)
        except ValueError as err:
            raise limits.bad_request(str(err)) from None
        return spec

    def _adapters(self, spec: str | None, deadline: float | None) -> dict[str, Any]:
        """The pipeline call's extra argument: the adapters `spec` names, looked up and downloaded
        now (a bad_request names the field; PastDeadline past the deadline)."""
        if self.backend != "genai":
            return {}
        if spec is None:
            return {"adapters": [(self.pipe.own, 1.0)] if self.pipe.own is not None else []}

        def check(what: str) -> None:
            if deadline is not None and time.monotonic() > deadline:
                raise limits.PastDeadline(f"before {what}")
        try:
            return {"adapters": self.pipe.resolve(spec, check)}
        except ValueError as err:
            raise limits.bad_request(str(err)) from None

    def _generate(self, prompt: str, seed: int, settings: dict[str, Any], deadline: float | None) -> dict[str, Any]:
        import torch

        if deadline is not None and time.monotonic() > deadline:
            raise limits.PastDeadline("before its first step")
        image = pipeline_call.generate(
            self.pipe, prompt, steps=settings["num_inference_steps"], guidance=settings["guidance_scale"],
            height=settings["height"], width=settings["width"], generator=torch.Generator("cpu").manual_seed(seed),
            callback=None if deadline is None else limits.stop_at(deadline), extra=settings["adapters"],
            image=settings["image"] or None, **self.convention)[0]
        return {"prompt": prompt, "seed": seed, "image": to_png_base64(image)}


mlflow.models.set_model(DiffusionImageModel())
