"""One call of a text-to-image pipeline, the same for every stage and for the served model.

A diffusers pipeline, an optimum-intel `OV*Pipeline` and the GenAI stand-ins (tasks/common/genai.py,
genai_serving.py) are all called here, so how a prompt, a size, a step count, a guidance value and
input images reach a pipeline is written once. What differs between families is in the family's
`CallConvention` (convention.py), recorded with a registered model; the size of every call is
decided by size.py.

Only the arguments given are passed: a value left None leaves the pipeline's own default, so a
caller that never set, say, the guidance keeps generating exactly what it generated before. The
size is the exception: every call passes the one size.py decides (what was asked, an input image's,
or the pipeline's default), so what a served request is charged for is what is made.
"""
from __future__ import annotations

from typing import Any

from finetune_runtime.convention import CallConvention
from finetune_runtime.size import output_size, shape_of


def call_arguments(prompts: list[str] | str, convention: CallConvention, *, steps: int, height: int | None = None,
                   width: int | None = None, guidance: float | None = None, negative: list[str] | str | None = None,
                   generator: Any = None, images_per_prompt: int | None = None, output_type: str | None = None,
                   callback: Any = None, image: Any = None, frames: int | None = None) -> dict[str, Any]:
    """The keyword arguments of one pipeline call (the prompt by name: FLUX.2 klein's first
    positional argument is an input image). `image`: an edit's input (reference) images, a list of
    PIL images that every prompt of the call sees (FLUX.2 klein's `image`). `frames`: a video
    pipeline's clip length (the convention's where None; an image pipeline takes none)."""
    if negative is None and convention.negative_when_guided is not None and guidance is not None and guidance > 1:
        guided = convention.negative_when_guided
        negative = guided if isinstance(prompts, str) else [guided] * len(prompts)
    optional = {
        "negative_prompt": negative,
        convention.count_argument: images_per_prompt,
        "height": height,
        "width": width,
        convention.guidance_argument: guidance,
        "generator": generator,
        "output_type": output_type,
        "callback_on_step_end": callback,
        "image": image,
        "num_frames": (frames or convention.frames or None) if convention.frames else None,
    }
    if convention.area_argument is not None and height is not None and width is not None:
        optional[convention.area_argument] = height * width
    return {"prompt": prompts, "num_inference_steps": steps, **convention.arguments,
            **{k: v for k, v in optional.items() if v is not None}}


def generate(pipe: Any, prompts: list[str] | str, convention: CallConvention, *, latents: Any = None,
             extra: dict[str, Any] | None = None, height: int | None = None, width: int | None = None,
             exported: tuple[int, int] | None = None, **settings: Any) -> list[Any]:
    """`pipe`'s images (a video pipeline's clips, each a list of frames) for `prompts` (see call_arguments
    for `settings`), at the size size.py decides
    from `height`, `width`, the first input image and the pipeline (`exported`: the size a dynamic
    OpenVINO export was saved at). `latents` (a tensor or array) is passed as given; `extra`:
    arguments only some pipelines take (GenAI's `adapters`)."""
    if convention.one_prompt_per_call and not isinstance(prompts, str) and len(prompts) > 1:
        return [image for i in range(len(prompts))
                for image in generate(pipe, prompts[i], convention, latents=_row(latents, i, len(prompts)),
                                      extra=extra, height=height, width=width, exported=exported,
                                      **{k: _row(v, i, len(prompts)) if k in ("generator", "negative") else v
                                         for k, v in settings.items()})]
    image = settings.get("image")
    first = image[0].size if image else None
    height, width = output_size(shape_of(pipe, convention, exported), convention, height, width, first)
    kwargs = call_arguments(prompts, convention, height=height, width=width, **settings)
    if latents is not None:
        kwargs["latents"] = latents
    output = pipe(**kwargs, **(extra or {}))
    return output.frames if convention.frames else output.images


def _row(value: Any, i: int, prompts: int) -> Any:
    """Prompt `i`'s share of a per-image value of a call of `prompts` prompts (latents, generators and
    negative prompts given per image or per prompt); a shared value as it is."""
    if value is None or isinstance(value, str) or not hasattr(value, "__len__") or len(value) % prompts:
        return value
    per = len(value) // prompts
    return value[i * per : (i + 1) * per]
