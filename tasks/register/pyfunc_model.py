"""The registered model's code: an MLflow pyfunc that turns prompts into images.

Logged as "models from code" (MLflow copies this file into the model), so it must stand alone:
it imports nothing from this repository. Its two artifacts are the fine-tuned diffusers pipeline
(`finetuned`) and its OpenVINO export (`openvino`). It runs the OpenVINO export when optimum-intel
imports (fast on CPU), compiled at the precision the export stage validated it at (its
`openvino_runtime.json`), and the diffusers pipeline otherwise; `FINETUNE_PYFUNC_BACKEND=openvino|
diffusers` forces one.

Input: a list of prompts, or a DataFrame with a `prompt` column. Params (all optional): `seed`,
`num_inference_steps`, `guidance_scale`, `height`, `width`, `num_images_per_prompt`. `SETTINGS`
below holds their types, defaults and allowed ranges (the signature is built from it), and
`check_request` refuses anything outside them, before any image is generated, with an
MlflowException of INVALID_PARAMETER_VALUE that names the field and the allowed range
(`mlflow models serve` answers it with HTTP 400). Output: a DataFrame with `prompt`, `seed` and
`image` (a base64-encoded PNG), one row per image, which `mlflow models serve` returns as JSON.
Image k of the request (prompt by prompt, then image by image) is generated with seed `seed + k`,
one image per pipeline call, so results do not depend on the batch and static-shape OpenVINO
exports (batch 1) accept any number of prompts; one request at a time per process (a lock: the
server runs requests in threads and a pipeline is not thread-safe).

MLflow enforces the signature before `predict` runs, in `mlflow models serve` and in a loaded
model's `predict()` alike: params of the wrong type are refused there, but params the signature
does not declare are dropped with a warning (MLflow's choice), so `check_settings`' refusal of
unknown names only acts when this class's `predict` is called directly.
"""
from __future__ import annotations

import base64
import io
import json
import logging
import math
import os
import threading
from dataclasses import dataclass
from typing import Any

import mlflow
import pandas as pd

log = logging.getLogger("sd_pyfunc")

BACKEND_ENV = "FINETUNE_PYFUNC_BACKEND"


@dataclass(frozen=True)
class Setting:
    """One generation param: MLflow type, default, inclusive range."""

    type: str  # "long" | "double"
    default: Any
    low: float
    high: float

    def describe(self) -> str:
        if self.type == "long":
            kind, low, high = "an integer", str(int(self.low)), str(int(self.high))
        else:
            kind, low, high = "a number", f"{self.low:g}", f"{self.high:g}"
        default = "the model's own" if self.default is None else self.default
        return f"{kind} from {low} to {high} (default {default})"


#: Every limit of a request, in one place (README "The registry" lists them).
SETTINGS: dict[str, Setting] = {
    "seed": Setting("long", 0, 0, 2**32 - 1),
    "num_inference_steps": Setting("long", 20, 1, 100),
    "guidance_scale": Setting("double", 7.5, 0.0, 30.0),
    "height": Setting("long", None, 64, 1024),  # also a multiple of the model's VAE scale factor
    "width": Setting("long", None, 64, 1024),
    "num_images_per_prompt": Setting("long", 1, 1, 4),
}
MAX_PROMPTS = 8
MAX_PROMPT_CHARS = 1000
MAX_IMAGES = 16  # prompts x num_images_per_prompt in one request: bounds its time and memory
DEFAULTS: dict[str, Any] = {name: s.default for name, s in SETTINGS.items()}


def signature() -> Any:
    """Prompts in (a string column), base64 PNGs out, SETTINGS as typed optional params."""
    from mlflow.models import ModelSignature
    from mlflow.types.schema import ColSpec, ParamSchema, ParamSpec, Schema

    return ModelSignature(
        inputs=Schema([ColSpec("string")]),  # unnamed: a plain list of prompts validates
        outputs=Schema([ColSpec("string", "prompt"), ColSpec("long", "seed"), ColSpec("string", "image")]),
        params=ParamSchema([ParamSpec(n, s.type, s.default) for n, s in SETTINGS.items()]),
    )


def bad_request(message: str) -> Exception:
    """The error a caller can fix: HTTP 400 from `mlflow models serve`, raised as is by predict()."""
    from mlflow.exceptions import MlflowException

    return MlflowException.invalid_parameter_value(message)


def _number(name: str, value: Any, setting: Setting) -> int | float:
    integral = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    ok_type = integral if setting.type == "long" else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok_type or not math.isfinite(value):
        raise bad_request(f"{name}: {value!r} is not {setting.describe()}")
    if not setting.low <= value <= setting.high:
        raise bad_request(f"{name}: {value!r} is out of range; allowed: {setting.describe()}")
    return int(value) if setting.type == "long" else float(value)


def check_settings(params: dict[str, Any] | None, size_multiple: int = 8) -> dict[str, Any]:
    """The request's settings with defaults filled in, or a bad_request naming the field and range."""
    params = dict(params or {})
    if unknown := sorted(set(params) - set(SETTINGS)):
        raise bad_request(f"unknown params {unknown}; allowed: {sorted(SETTINGS)}")
    settings = dict(DEFAULTS)
    for name, value in params.items():
        if value is not None:
            settings[name] = _number(name, value, SETTINGS[name])
    for name in ("height", "width"):
        if settings[name] is not None and settings[name] % size_multiple:
            raise bad_request(f"{name}: {settings[name]} is not a multiple of {size_multiple}, which this "
                              f"model needs; allowed: {SETTINGS[name].describe()}, a multiple of {size_multiple}")
    return settings


def check_request(model_input: Any, params: dict[str, Any] | None, size_multiple: int = 8) -> tuple[list[str], dict]:
    """(prompts, settings) of a valid request; a bad_request before any work otherwise."""
    prompts = prompts_from(model_input)
    settings = check_settings(params, size_multiple)
    images = len(prompts) * settings["num_images_per_prompt"]
    if images > MAX_IMAGES:
        raise bad_request(f"{len(prompts)} prompts x num_images_per_prompt {settings['num_images_per_prompt']} = "
                          f"{images} images; at most {MAX_IMAGES} per request: split it")
    return prompts, settings


def to_png_base64(image: Any) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def prompts_from(model_input: Any) -> list[str]:
    """Accept a list/Series of strings, or a DataFrame with a `prompt` column (or one column)."""
    if isinstance(model_input, pd.DataFrame):
        if "prompt" in model_input.columns:
            values = model_input["prompt"].tolist()
        elif len(model_input.columns) == 1:
            values = model_input.iloc[:, 0].tolist()
        else:
            raise bad_request(f"inputs: expected a 'prompt' column, got columns {list(model_input.columns)}")
    elif isinstance(model_input, pd.Series):
        values = model_input.tolist()
    elif isinstance(model_input, str):
        values = [model_input]
    elif isinstance(model_input, (list, tuple)):
        values = list(model_input)
    else:
        raise bad_request(f"inputs: expected a list of prompt strings, got {type(model_input).__name__}")
    if not 1 <= len(values) <= MAX_PROMPTS:
        raise bad_request(f"inputs: {len(values)} prompts; allowed: 1 to {MAX_PROMPTS} per request")
    for i, value in enumerate(values):
        if not isinstance(value, str) or not value.strip():
            raise bad_request(f"inputs[{i}]: {value!r} is not a prompt; allowed: a non-empty string")
        if len(value) > MAX_PROMPT_CHARS:
            raise bad_request(f"inputs[{i}]: {len(value)} characters; allowed: at most {MAX_PROMPT_CHARS}")
    return values


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


def _diffusers_pipeline(artifacts: dict[str, str]) -> Any:
    """The fine-tuned pipeline; LoRA adapters registered unfused are loaded onto their base."""
    from diffusers import DiffusionPipeline

    path = artifacts["finetuned"]
    if os.path.isfile(os.path.join(path, "model_index.json")):
        return DiffusionPipeline.from_pretrained(path)
    if "base" not in artifacts:
        raise ValueError(f"{path} holds no pipeline (model_index.json) and the model has no base")
    pipe = DiffusionPipeline.from_pretrained(artifacts["base"])
    pipe.load_lora_weights(path, weight_name="pytorch_lora_weights.safetensors")
    return pipe


class DiffusionImageModel(mlflow.pyfunc.PythonModel):
    """Prompts in, base64 PNGs out; the pipeline is loaded once per process."""

    def load_context(self, context: Any) -> None:
        # `mlflow models serve` runs each request in a thread of its worker: a pipeline (its
        # scheduler's step state, OpenVINO's infer requests) must not run two calls at once.
        self.lock = threading.Lock()
        if _want_openvino():
            from optimum.intel import OVDiffusionPipeline

            path = context.artifacts["openvino"]
            self.pipe = OVDiffusionPipeline.from_pretrained(path, ov_config=_runtime_config(path))
            self.backend = "openvino"
            self.pipe.set_progress_bar_config(disable=True)
        else:
            path = context.artifacts["finetuned"]
            self.pipe = _diffusers_pipeline(context.artifacts)
            self.pipe.set_progress_bar_config(disable=True)
            self.backend = "diffusers"
        log.info("loaded the %s pipeline from %s", self.backend, path)

    # Untyped on purpose: MLflow would read type hints as an input schema.
    def predict(self, context, model_input, params=None):
        """One row per image; see the module docstring for inputs, params and output."""
        prompts, settings = check_request(model_input, params, int(getattr(self.pipe, "vae_scale_factor", 8)))
        seed, per_prompt = settings["seed"], settings["num_images_per_prompt"]
        with self.lock:
            rows = [self._generate(prompts[k // per_prompt], seed + k, settings)
                    for k in range(len(prompts) * per_prompt)]
        return pd.DataFrame(rows, columns=["prompt", "seed", "image"])

    def _generate(self, prompt: str, seed: int, settings: dict[str, Any]) -> dict[str, Any]:
        import torch

        image = self.pipe(
            prompt=prompt,  # by name: FLUX.2 klein's first positional argument is an input image
            num_inference_steps=settings["num_inference_steps"],
            guidance_scale=settings["guidance_scale"],
            height=settings["height"],
            width=settings["width"],
            generator=torch.Generator("cpu").manual_seed(seed),
        ).images[0]
        return {"prompt": prompt, "seed": seed, "image": to_png_base64(image)}


mlflow.models.set_model(DiffusionImageModel())
