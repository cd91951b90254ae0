"""The registered model: an MLflow pyfunc that turns prompts into images.

Logged as "models from code" (MLflow loads mlflow_model.py, which sets this class), with this
package as its code (`code_paths`). Its artifacts (layout.py) are the fine-tuned diffusers pipeline
(`finetuned`) and its OpenVINO export (`openvino`), or the adapters and their base; load.py decides
which serves.

Input: a list of prompts, or a DataFrame with a `prompt` column. Params (all optional): `seed`,
`num_inference_steps`, `guidance_scale`, `height`, `width`, `num_images_per_prompt`, for a
base export's endpoint `adapter`, and for a model that edits (its call convention's
`input_images`) `image`, the input images: one base64 file or a JSON list of them (images.py). limits.py holds
their types, defaults and ranges, refuses anything outside them with HTTP 400, and bounds a
request's cost, queue and time; size.py decides the size of every image. Output: a DataFrame with
`prompt`, `seed` and `image` (a base64-encoded PNG), one row per image, which `mlflow models serve`
returns as JSON; a video model's (its call convention's `frames`) has `video` instead, a base64 MP4
(H.264) of the clip at the convention's `fps`, takes `num_frames` (frame_step x k + 1; default the
convention's), and its budget counts every frame. Image k of the
request (prompt by prompt, then image by image) is generated with seed `seed + k`, one image per
pipeline call, so results do not depend on the batch and static-shape OpenVINO exports (batch 1)
accept any number of prompts.
"""
from __future__ import annotations

import base64
import io
import logging
import time
from typing import Any

import mlflow
import pandas as pd

from finetune_runtime import images, limits, pipeline_call
from finetune_runtime.convention import CallConvention
from finetune_runtime.load import BACKENDS, Backend, Loaded, first_frame_pipeline, load
from finetune_runtime.quiet import libraries_quiet
from finetune_runtime.size import shape_of

log = logging.getLogger("sd_pyfunc")


def to_png_base64(image: Any) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def to_mp4_base64(frames: list[Any], fps: float) -> str:
    """A clip's PIL frames as a base64 MP4 (H.264, yuv420p, PyAV's bundled FFmpeg)."""
    from fractions import Fraction

    import av
    import numpy as np

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=Fraction(fps).limit_denominator(1001))
        stream.width, stream.height = frames[0].size
        stream.pix_fmt = "yuv420p"
        for frame in frames:
            out.mux(stream.encode(av.VideoFrame.from_ndarray(np.asarray(frame.convert("RGB")), format="rgb24")))
        out.mux(stream.encode())
    return base64.b64encode(buf.getvalue()).decode("ascii")


class DiffusionImageModel(mlflow.pyfunc.PythonModel):
    """Prompts in, base64 PNGs out; the pipeline is loaded once per process."""

    def load_context(self, context: Any) -> None:
        model_config = getattr(context, "model_config", None)
        cache_mb = limits.serving_config(model_config)["adapter_cache_mb"]
        with libraries_quiet():  # quiet.py: the libraries' import and load lines off, LOG_LEVEL=DEBUG shows them
            self.serve(load(dict(context.artifacts), model_config, cache_mb), model_config)
        log.info("loaded the %s pipeline from %s; a request may cost %s pixel-steps (%s), %d may wait, "
                 "timeout %s s", self.backend, self.path, self.budget.pixel_steps, self.budget.describe(),
                 self.turns.max_waiting, self.timeout_s)

    def serve(self, loaded: Loaded, model_config: dict[str, Any] | None) -> None:
        """Serve `loaded` with the call convention and the limits of `model_config` (limits.SERVING_DEFAULTS
        where it says nothing)."""
        config = limits.serving_config(model_config)
        self.convention = CallConvention.from_config(model_config)
        self.pipe, self.backend, self.path = loaded.pipe, loaded.backend, loaded.path
        # what the back end can do beside the call (load.BACKENDS; a stand-in pipeline's: nothing more)
        self.serving = BACKENDS.get(self.backend) if self.backend in BACKENDS else Backend(self.backend)
        self.loaded, self.first_frame = loaded, None  # a video model's image-to-video pipeline, made at first use
        self.pipe.set_progress_bar_config(disable=True)
        self.shape = shape_of(self.pipe, self.convention, loaded.exported)
        first_frame = self.convention.first_frame_pipeline is not None  # takes a latent frame's place: no extra
        self.budget = limits.Budget(config["budget_images"], *self.shape.default,
                                    input_images=0 if first_frame else self.convention.input_images,
                                    input_pixels=self.convention.input_pixels, frames=self.convention.frames or 1)
        self.output = "video" if self.convention.frames else "image"
        # `mlflow models serve` runs each request in a thread of its worker: a pipeline (its
        # scheduler's step state, OpenVINO's infer requests) must not run two calls at once.
        self.turns = limits.Turns(config["max_waiting"])
        self.timeout_s = limits.request_timeout()

    # `pd.DataFrame` is one of the hints MLflow infers no schema from (it warns on a missing hint
    # and would replace a list hint's schema for check_request's): requests (a list or a frame of
    # prompts) are checked by limits.check_request, typed and bounded, 400 naming the field.
    def predict(self, context, model_input: pd.DataFrame, params=None):
        """One row per image; see the module docstring for inputs, params and output."""
        with libraries_quiet(import_first=False):  # loaded: the libraries are imported
            return self._predict(model_input, params)

    def _predict(self, model_input: pd.DataFrame, params: dict[str, Any] | None) -> pd.DataFrame:
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        prompts, settings = limits.check_request(model_input, params, self.shape, self.convention, self.budget)
        spec = self._adapter_spec(settings.pop(limits.ADAPTER_PARAM), settings)
        seed, per_prompt = settings["seed"], settings["num_images_per_prompt"]
        rows: list[dict[str, Any]] = []
        # adapters are looked up, downloaded and compiled, input images decoded, in the model's turn,
        # under the deadline: a waiting request holds its images' files, not their pixels
        with self.turns.turn(deadline):
            try:
                settings["image"] = images.decoded(settings["image"])
                settings["adapters"] = self._adapters(spec, deadline)
                for k in range(len(prompts) * per_prompt):
                    rows.append(self._generate(prompts[k // per_prompt], seed + k, settings, deadline))
            except limits.PastDeadline as stop:
                log.warning("stopped a request at image %d of %d, %s: past its %g s (%s)", len(rows) + 1,
                            len(prompts) * per_prompt, stop, self.timeout_s, limits.TIMEOUT_ENV)
                raise limits.timed_out(
                    f"stopped after {self.timeout_s:g} s ({limits.TIMEOUT_ENV}), at image {len(rows) + 1} of "
                    f"{len(prompts) * per_prompt}, {stop}: lower the cost or raise the server's --timeout") from None
        return pd.DataFrame(rows, columns=["prompt", "seed", self.output])

    def _adapter_spec(self, spec: str, settings: dict[str, Any]) -> str | None:
        """The `adapter` param checked before the queue (no look-up): None where the endpoint
        applies no adapter or its own; a bad_request names the field."""
        per_request = self.serving.request_adapters  # GenAI's run-time adapters
        if per_request and settings["guidance_scale"] <= 1:
            raise limits.bad_request(f"guidance_scale: {settings['guidance_scale']:g}; this base export is compiled "
                              "with classifier-free guidance: allowed above 1")
        if not per_request or self.pipe.own is not None:
            if spec:
                raise limits.bad_request(f"{limits.ADAPTER_PARAM}: this endpoint serves one fine-tune; adapters are "
                                  "applied by the endpoint of their registered base export (<model>-base)")
            return None
        from finetune_runtime import genai_serving

        try:
            genai_serving.parse_adapters(spec)
        except ValueError as err:
            raise limits.bad_request(str(err)) from None
        return spec

    def _adapters(self, spec: str | None, deadline: float | None) -> dict[str, Any]:
        """The pipeline call's extra argument: the adapters `spec` names, looked up and downloaded
        now (a bad_request names the field; PastDeadline past the deadline)."""
        if not self.serving.request_adapters:
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

    def _pipe_for(self, inputs: list[Any]) -> Any:
        """The pipeline of a call: a video model's first-frame pipeline where the request gave one (made at
        its first use, in the request's turn), else the model's."""
        name = self.convention.first_frame_pipeline
        if not inputs or name is None:
            return self.pipe
        if self.first_frame is None:
            try:
                self.first_frame = first_frame_pipeline(self.loaded, name)
            except ValueError as err:
                raise limits.bad_request(f"{images.IMAGE_PARAM}: {err}") from None
            self.first_frame.set_progress_bar_config(disable=True)
        return self.first_frame

    def _generate(self, prompt: str, seed: int, settings: dict[str, Any], deadline: float | None) -> dict[str, Any]:
        import torch

        if deadline is not None and time.monotonic() > deadline:
            raise limits.PastDeadline("before its first step")
        image = pipeline_call.generate(
            self._pipe_for(settings["image"]), prompt, self.convention, steps=settings["num_inference_steps"],
            guidance=settings["guidance_scale"], height=settings["height"], width=settings["width"],
            generator=torch.Generator("cpu").manual_seed(seed), extra=settings["adapters"],
            callback=None if deadline is None else limits.stop_at(deadline), image=settings["image"] or None,
            frames=settings.get(limits.FRAMES_PARAM))[0]
        if self.output == "video":  # a clip: its frames
            return {"prompt": prompt, "seed": seed, "video": to_mp4_base64(image, self.convention.fps)}
        return {"prompt": prompt, "seed": seed, "image": to_png_base64(image)}

