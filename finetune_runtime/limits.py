"""What a request may ask of a served model, and how long it may wait: the pyfunc's limits.

`SETTINGS` holds every generation param's type, default and allowed
range (the signature is built from it), and `check_request` refuses anything outside them, before
any image is generated, with an MlflowException of INVALID_PARAMETER_VALUE that names the field
and the allowed range (`mlflow models serve` answers it with HTTP 400).

Serving cannot be tied up (docs/registry.md, "The registry", "Limits of a served model"):
- cost: prompts x num_images_per_prompt x num_inference_steps x height x width must stay within
  the model's budget, `budget_images` images at its default size and steps (model_config; an edit
  model's images are edits, each with the most input images it takes at that size), checked
  with the other settings, before any work: a bad_request (HTTP 400) naming the fields and budget;
- queue: one request at a time per process (the server runs requests in threads and a pipeline
  is not thread-safe), at most `max_waiting` (model_config) waiting for it; the next is refused at
  once with REQUEST_LIMIT_EXCEEDED (HTTP 429) and `retry_after_s` in the body;
- time: under `mlflow models serve` each request gets the server's timeout
  (MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT, `--timeout`, from when predict starts): a waiting request
  gives up then, and a generating one stops at its next denoising step (the pipeline's
  `callback_on_step_end` raises), so the model is free again right after the server's HTTP 504.

MLflow enforces the signature before `predict` runs, in `mlflow models serve` and in a loaded
model's `predict()` alike: params of the wrong type are refused there, but params the signature
does not declare are dropped with a warning (MLflow's choice), so `check_settings`' refusal of
unknown names only acts when the pyfunc's `predict` is called directly.
"""
from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pandas as pd

from finetune_runtime import images
from finetune_runtime.convention import CallConvention
from finetune_runtime.size import Shape, SizeError, output_size


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


#: Every limit of a request, in one place (docs/registry.md, "The registry", lists them).
SETTINGS: dict[str, Setting] = {
    "seed": Setting("long", 0, 0, 2**32 - 1),
    "num_inference_steps": Setting("long", 20, 1, 100),
    "guidance_scale": Setting("double", 7.5, 0.0, 30.0),
    "height": Setting("long", None, 64, 1024),  # also a multiple of the model's VAE scale factor (size.py)
    "width": Setting("long", None, 64, 1024),
    "num_images_per_prompt": Setting("long", 1, 1, 4),
}
#: The one text param: the registered adapters a base export's endpoint applies (genai_serving.py).
ADAPTER_PARAM = "adapter"
#: A video model's param (its signature has it, an image model's not): the clip's frames, frame_step x k + 1
FRAMES_PARAM = "num_frames"
FRAMES = Setting("long", None, 1, 257)
MAX_PROMPTS = 8
MAX_PROMPT_CHARS = 1000
MAX_IMAGES = 16  # prompts x num_images_per_prompt in one request: bounds its time and memory
DEFAULTS: dict[str, Any] = {name: s.default for name, s in SETTINGS.items()}
#: The model's serving config (logged as its `model_config`; a served process may override a key
#: through MLflow's MLFLOW_PYFUNC_INFERENCE_CONFIG): a request may cost at most `budget_images`
#: images at the model's default size and steps; at most `max_waiting` requests wait for the model;
#: a base export's endpoint keeps at most `adapter_cache_mb` MB of downloaded adapters on disk.
SERVING_DEFAULTS: dict[str, Any] = {"budget_images": 4.0, "max_waiting": 4, "adapter_cache_mb": 1024.0}
TIMEOUT_ENV = "MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT"  # what `mlflow models serve --timeout` sets


def signature(video: bool = False) -> Any:
    """Prompts in (a string column), base64 PNGs out (a video model's: base64 MP4s, column `video`),
    SETTINGS as typed optional params."""
    from mlflow.models import ModelSignature
    from mlflow.types.schema import ColSpec, ParamSchema, ParamSpec, Schema

    return ModelSignature(
        inputs=Schema([ColSpec("string")]),  # unnamed: a plain list of prompts validates
        outputs=Schema([ColSpec("string", "prompt"), ColSpec("long", "seed"),
                        ColSpec("string", "video" if video else "image")]),
        params=ParamSchema([ParamSpec(n, s.type, s.default) for n, s in SETTINGS.items()]
                           + ([ParamSpec(FRAMES_PARAM, FRAMES.type, FRAMES.default)] if video else [])
                           + [ParamSpec(ADAPTER_PARAM, "string", ""),
                              # an edit's input images: one string (a base64 file or a JSON list of them), not
                              # a list param, which MLflow would turn into a fixed-width array (images.py)
                              ParamSpec(images.IMAGE_PARAM, "string", "")]),
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
    adapter = params.pop(ADAPTER_PARAM, None) or ""
    params.pop(images.IMAGE_PARAM, None)  # check_request decodes them
    if unknown := sorted(set(params) - set(SETTINGS)):
        allowed = sorted([*SETTINGS, ADAPTER_PARAM, images.IMAGE_PARAM])
        raise bad_request(f"unknown params {unknown}; allowed: {allowed}")
    if not isinstance(adapter, str) or len(adapter) > MAX_PROMPT_CHARS:
        raise bad_request(f"{ADAPTER_PARAM}: {adapter!r} is not a text of at most {MAX_PROMPT_CHARS} characters")
    settings = {**DEFAULTS, ADAPTER_PARAM: adapter}
    for name, value in params.items():
        if value is not None:
            settings[name] = _number(name, value, SETTINGS[name])
    for name in ("height", "width"):
        if settings[name] is not None and settings[name] % size_multiple:
            raise bad_request(f"{name}: {settings[name]} is not a multiple of {size_multiple}, which this "
                              f"model needs; allowed: {SETTINGS[name].describe()}, a multiple of {size_multiple}")
    return settings


@dataclass(frozen=True)
class Budget:
    """What one request may cost: `images` images of `height` x `width` at `steps` steps, the
    model's defaults. Cost = images x num_inference_steps x height x width (pixel-steps): a
    denoising step's time and memory grow with its pixels, a request's time with its steps.

    An edit model's image at its defaults is an edit: `input_images` (the most its call takes) at
    that size join every step beside it, so each of the `images` counts them: a budget of 4 holds 4
    edits at the default size with every input image a call may take (else one default edit with 4
    inputs, 5 images' pixels, would be over the default budget of 4, and an edit of an input image
    twice the default side, made at that size, would be refused at the default settings).

    A video model's output is a clip of `frames` frames: each frame's pixels count (frames x steps x pixels)."""

    images: float
    height: int
    width: int
    steps: int = SETTINGS["num_inference_steps"].default
    input_images: int = 0
    #: the pixels each input image is encoded at whatever its size (CallConvention.input_pixels), or None:
    #: at the default size
    input_pixels: int | None = None
    #: the frames of a video model's clip (1: an image)
    frames: int = 1

    @property
    def default_image(self) -> int:
        """The pixel-steps of one image (an edit model's: one edit, its input images included; a video model's:
        one clip) at the defaults."""
        return self.steps * (self.height * self.width * self.frames + self.input_images * self._input_size())

    def _input_size(self) -> int:
        return self.input_pixels or self.height * self.width

    def describe(self) -> str:
        """'4 images of 64x64 px at 20 steps'; an edit model's: '4 edits of ..., each with 4 input images of
        that size'."""
        if self.frames > 1:
            return (f"{self.images:g} clips of {self.frames} frames of {self.height}x{self.width} px at "
                    f"{self.steps} steps")
        if not self.input_images:
            return f"{self.images:g} images of {self.height}x{self.width} px at {self.steps} steps"
        mp = (self.input_pixels or 0) / 2**20
        size = f"{mp:.3g} megapixel{'' if mp == 1 else 's'}" if self.input_pixels else "that size"
        return (f"{self.images:g} edits of {self.height}x{self.width} px at {self.steps} steps, each with "
                f"{self.input_images} input image{'s' if self.input_images > 1 else ''} of {size}")

    @property
    def pixel_steps(self) -> int:
        return int(self.images * self.default_image)

    def check(self, prompts: int, settings: dict[str, Any], input_pixels: int = 0) -> None:
        """A bad_request naming the fields and the budget when the request costs more than it.

        `settings` carry the size the request will be made at (size.output_size); `input_pixels`: an
        edit's input images, as encoded (their tokens join every step)."""
        height, width = settings["height"], settings["width"]
        per_prompt, steps = settings["num_images_per_prompt"], settings["num_inference_steps"]
        frames = settings.get(FRAMES_PARAM) or 1
        cost = prompts * per_prompt * steps * (height * width * frames + input_pixels)
        if cost <= self.pixel_steps:
            return
        pixels = f"(height {height} x width {width} + {images.IMAGE_PARAM} {input_pixels} px)" if input_pixels \
            else f"height {height} x width {width}" + (f" x {FRAMES_PARAM} {frames}" if self.frames > 1 else "")
        raise bad_request(
            f"request cost {prompts} prompts x num_images_per_prompt {per_prompt} x num_inference_steps "
            f"{steps} x {pixels} = {cost} pixel-steps ({cost / self.default_image:.3g} "
            f"default {'edits' if self.input_images else 'clips' if self.frames > 1 else 'images'}) is over this "
            f"model's budget of {self.pixel_steps} ({self.describe()}; model_config budget_images): lower "
            "num_images_per_prompt, num_inference_steps, height or width, or split the request")


def check_request(model_input: Any, params: dict[str, Any] | None, shape: Shape,
                  convention: CallConvention, budget: Budget | None = None) -> tuple[list[str], dict]:
    """(prompts, settings) of a valid request; a bad_request before any work otherwise.

    settings[`height`], [`width`]: the size the request is made at (size.output_size: the pipeline's
    `shape`, what was asked, the first input image's size); settings[`image`]: the input images, their
    headers checked, pixels not yet decoded (images.decoded, in the request's turn), at most the
    convention's `input_images` ([] without)."""
    prompts = prompts_from(model_input)
    frames = _frames((params or {}).get(FRAMES_PARAM), convention)
    settings = check_settings({k: v for k, v in (params or {}).items() if k != FRAMES_PARAM or not convention.frames},
                              shape.multiple)
    if frames is not None:  # a video model's
        settings[FRAMES_PARAM] = frames
    count = len(prompts) * settings["num_images_per_prompt"]
    if count > MAX_IMAGES:
        raise bad_request(f"{len(prompts)} prompts x num_images_per_prompt {settings['num_images_per_prompt']} = "
                          f"{count} images; at most {MAX_IMAGES} per request: split it")
    inputs = images.input_images((params or {}).get(images.IMAGE_PARAM), convention.input_images,
                                 convention.min_input_images)
    try:
        settings["height"], settings["width"] = output_size(
            shape, convention, settings["height"], settings["width"], inputs[0].size if inputs else None,
            int(SETTINGS["height"].high))
    except SizeError as err:
        raise bad_request(str(err)) from None
    if budget is not None:  # (a video's first frame takes its first latent frame's place: no extra pixels)
        budget.check(len(prompts), settings, 0 if convention.first_frame_pipeline else
                     images.encoded_pixels(inputs, convention.edit_pixels, convention.input_pixels))
    settings[images.IMAGE_PARAM] = inputs
    return prompts, settings


def _frames(value: Any, convention: CallConvention) -> int | None:
    """A video model's clip length: `value` checked (FRAMES' range, frame_step x k + 1), or the convention's
    default; None for an image model (which has no such param: check_settings refuses it by name)."""
    if not convention.frames:
        return None
    if value is None:
        return convention.frames
    frames = _number(FRAMES_PARAM, value, FRAMES)
    if (step := convention.frame_step) and (frames - 1) % step:
        good = ", ".join(str(step * k + 1) for k in range(1, 4))
        raise bad_request(f"{FRAMES_PARAM}: {frames} is not {step}k+1 frames, which this model's VAE takes; "
                          f"allowed: {good}, ... up to {int(FRAMES.high)}")
    return frames


def serving_config(model_config: dict[str, Any] | None) -> dict[str, Any]:
    """SERVING_DEFAULTS updated from the model's config, checked (a bad value stops the load)."""
    config = {**SERVING_DEFAULTS, **{k: v for k, v in (model_config or {}).items() if k in SERVING_DEFAULTS}}
    waiting = config["max_waiting"]
    for name in ("budget_images", "adapter_cache_mb"):
        value = config[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise ValueError(f"model_config {name}: {value!r} is not a number above 0")
    if isinstance(waiting, bool) or not isinstance(waiting, int) or waiting < 0:
        raise ValueError(f"model_config max_waiting: {waiting!r} is not an integer from 0")
    return {"budget_images": float(config["budget_images"]), "max_waiting": waiting,
            "adapter_cache_mb": float(config["adapter_cache_mb"])}

def request_timeout() -> float | None:
    """The server's request timeout in seconds (`mlflow models serve --timeout`), None outside it."""
    value = os.environ.get(TIMEOUT_ENV)
    try:
        return float(value) if value else None
    except ValueError:
        return None

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


def busy(message: str, retry_after_s: int) -> Exception:
    """The model's wait queue is full: HTTP 429 from `mlflow models serve`, `retry_after_s` in its body.

    MLflow's scoring server answers a model's MlflowException with the status of its error code and
    a JSON body (its message plus the exception's keyword arguments); it sets no header, so the
    retry delay travels in the body, not as a Retry-After header."""
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import REQUEST_LIMIT_EXCEEDED

    return MlflowException(message, error_code=REQUEST_LIMIT_EXCEEDED, retry_after_s=retry_after_s)


def timed_out(message: str) -> Exception:
    """The request's time is up: HTTP 504 (the server has usually answered 504 already)."""
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import DEADLINE_EXCEEDED

    return MlflowException(message, error_code=DEADLINE_EXCEEDED)


class PastDeadline(Exception):
    """Raised from the pipeline's step callback: stops the denoising loop where it is."""


def stop_at(deadline: float) -> Any:
    """A diffusers `callback_on_step_end` that raises PastDeadline once `deadline` (monotonic) is past."""
    def callback(pipe: Any, step: int, timestep: Any, callback_kwargs: dict) -> dict:
        if time.monotonic() > deadline:
            raise PastDeadline(f"step {step + 1}")
        return callback_kwargs
    return callback


class Turns:
    """The model runs one request at a time; at most `max_waiting` more wait for it, the next is
    refused at once (`busy`), and a waiting request gives up at its deadline (`timed_out`).

    `mlflow models serve` runs each request in a thread of asyncio's default pool (min(32, CPUs + 4)
    threads): a request refused here frees its thread at once, so the pool's own queue stays short
    as long as max_waiting + 1 is below the pool's size."""

    def __init__(self, max_waiting: int) -> None:
        self.max_waiting = max_waiting
        self.model = threading.Lock()  # held by the request generating
        self.guard = threading.Lock()  # for `waiting` and `hold_s`
        self.waiting = 0
        self.hold_s = 1.0  # moving average of how long a request holds the model

    @contextlib.contextmanager
    def turn(self, deadline: float | None) -> Iterator[None]:
        with self.guard:
            got = self.model.acquire(blocking=False)
            if not got and self.waiting >= self.max_waiting:
                retry = max(1, math.ceil(self.hold_s * (self.waiting + 1)))
                raise busy(f"the model is busy: one request generating and {self.waiting} waiting, the most "
                           f"this server queues (model_config max_waiting {self.max_waiting}); retry after "
                           f"about {retry} s", retry)
            self.waiting += 0 if got else 1
        if not got:
            wait = -1 if deadline is None else max(0.0, deadline - time.monotonic())
            got = self.model.acquire(timeout=wait)
            with self.guard:
                self.waiting -= 1
            if not got:
                raise timed_out(f"waited {wait:.2g} s for the model, the request's whole time "
                                f"({TIMEOUT_ENV}); nothing was generated")
        start = time.monotonic()
        try:
            yield
        finally:
            with self.guard:
                self.hold_s = 0.7 * self.hold_s + 0.3 * (time.monotonic() - start)
            self.model.release()
