"""One call of a text-to-image pipeline, the same for every stage and for the served model.

A diffusers pipeline, an optimum-intel `OV*Pipeline` and the GenAI stand-ins (tasks/common/genai.py,
tasks/register/genai_serving.py) are all called here, so how a prompt, a size, a step count and a
guidance value reach a pipeline is written once. What differs between families is the family's
to say (`ModelFamily.generate` passes its `guidance_argument`); this module is logged beside the
served model's code (MLflow `code_paths`), so it imports nothing from this repository.

Only the arguments given are passed: a value left None leaves the pipeline's own default, so a
caller that never set, say, the guidance keeps generating exactly what it generated before.
"""
from __future__ import annotations

from typing import Any

#: The keyword each family's pipeline reads its guidance from when none is declared.
GUIDANCE_ARGUMENT = "guidance_scale"


def call_arguments(prompts: list[str] | str, *, steps: int, height: int | None = None, width: int | None = None,
                   guidance: float | None = None, negative: list[str] | str | None = None,
                   generator: Any = None, images_per_prompt: int | None = None,
                   output_type: str | None = None, callback: Any = None, image: Any = None,
                   guidance_argument: str = GUIDANCE_ARGUMENT, negative_when_guided: str | None = None,
                   arguments: dict[str, Any] | None = None) -> dict[str, Any]:
    """The keyword arguments of one pipeline call (the prompt by name: FLUX.2 klein's first
    positional argument is an input image). `negative_when_guided`: the negative prompt a call with
    guidance above 1 and none of its own sends (Qwen-Image's true CFG runs only with one);
    `arguments`: what the family's call convention passes on every call, None values included
    (Sana: `complex_human_instruction=None`, as it trains); `image`: an edit's input (reference)
    images, a list of PIL images that every prompt of the call sees (FLUX.2 klein's `image`)."""
    if negative is None and negative_when_guided is not None and guidance is not None and guidance > 1:
        negative = negative_when_guided if isinstance(prompts, str) else [negative_when_guided] * len(prompts)
    optional = {
        "negative_prompt": negative,
        "num_images_per_prompt": images_per_prompt,
        "height": height,
        "width": width,
        guidance_argument: guidance,
        "generator": generator,
        "output_type": output_type,
        "callback_on_step_end": callback,
        "image": image,
    }
    return {"prompt": prompts, "num_inference_steps": steps, **(arguments or {}),
            **{k: v for k, v in optional.items() if v is not None}}


def generate(pipe: Any, prompts: list[str] | str, *, latents: Any = None, extra: dict[str, Any] | None = None,
             default_sample_size: int | None = None, **settings: Any) -> list[Any]:
    """`pipe`'s images for `prompts` (see call_arguments for `settings`). `latents` (a tensor or
    array) is passed as given; `extra`: arguments only some pipelines take (GenAI's `adapters`);
    `default_sample_size`: with no size given, this latent side times the VAE's factor (a family
    whose pipeline hard-codes its pixel size, which a small VAE would make far larger)."""
    if default_sample_size and settings.get("height") is None and settings.get("width") is None:
        side = default_sample_size * int(getattr(pipe, "vae_scale_factor", 8))
        settings = {**settings, "height": side, "width": side}
    kwargs = call_arguments(prompts, **settings)
    if latents is not None:
        kwargs["latents"] = latents
    return pipe(**kwargs, **(extra or {})).images
