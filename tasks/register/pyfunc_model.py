"""The registered model's code: an MLflow pyfunc that turns prompts into images.

Logged as "models from code" (MLflow copies this file into the model), so it must stand alone:
it imports nothing from this repository. Its two artifacts are the fine-tuned diffusers pipeline
(`finetuned`) and its OpenVINO export (`openvino`). It runs the OpenVINO export when optimum-intel
imports (fast on CPU), compiled at the precision the export stage validated it at (its
`openvino_runtime.json`), and the diffusers pipeline otherwise; `FINETUNE_PYFUNC_BACKEND=openvino|
diffusers` forces one.

Input: a list of prompts, or a DataFrame with a `prompt` column. Params (all optional): `seed`,
`num_inference_steps`, `guidance_scale`, `height`, `width`. Output: a DataFrame with `prompt`,
`seed` and `image` (a base64-encoded PNG), which `mlflow models serve` returns as JSON.
Prompt i is generated with seed `seed + i`, one prompt at a time, so results do not depend on
the batch and static-shape OpenVINO exports (batch 1) accept any number of prompts.
"""
from __future__ import annotations

import base64
import io
import json
import logging
import os
from typing import Any

import mlflow
import pandas as pd

log = logging.getLogger("sd_pyfunc")

BACKEND_ENV = "FINETUNE_PYFUNC_BACKEND"
DEFAULTS: dict[str, Any] = {
    "seed": 0,
    "num_inference_steps": 20,
    "guidance_scale": 7.5,
    "height": None,  # None: the model's own size (an OpenVINO export has static shapes)
    "width": None,
}


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
            raise ValueError(f"expected a 'prompt' column, got columns {list(model_input.columns)}")
    elif isinstance(model_input, pd.Series):
        values = model_input.tolist()
    elif isinstance(model_input, str):
        values = [model_input]
    else:
        values = list(model_input)
    if not values or not all(isinstance(v, str) and v.strip() for v in values):
        raise ValueError("predict() needs one or more non-empty prompt strings")
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
        """One image per prompt; see the module docstring for inputs, params and output."""
        import torch

        settings = {**DEFAULTS, **{k: v for k, v in (params or {}).items() if v is not None}}
        prompts = prompts_from(model_input)
        seed = int(settings["seed"])
        rows = []
        for i, prompt in enumerate(prompts):
            generator = torch.Generator("cpu").manual_seed(seed + i)
            image = self.pipe(
                prompt,
                num_inference_steps=int(settings["num_inference_steps"]),
                guidance_scale=float(settings["guidance_scale"]),
                height=settings["height"],
                width=settings["width"],
                generator=generator,
            ).images[0]
            rows.append({"prompt": prompt, "seed": seed + i, "image": to_png_base64(image)})
        return pd.DataFrame(rows, columns=["prompt", "seed", "image"])


mlflow.models.set_model(DiffusionImageModel())
