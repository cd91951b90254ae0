"""How a family's pipeline is called, as one frozen record: what the stages pass and the served model reads.

The families (tasks/common/families/) build it (`ModelFamily.call_convention`); the register stage
stores it in the model's config (`pipeline_call`), so the served model, which cannot import the
families, calls its pipeline exactly as the stages do. Everything the served code needs to know
about a family lives here, not in serving code.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

#: The model_config key the convention is stored under.
CONFIG_KEY = "pipeline_call"
#: Input images a call of a family that edits may take: each one's tokens join every denoising step,
#: so they are bounded like the images a request asks for.
MAX_INPUT_IMAGES = 4


@dataclass(frozen=True)
class CallConvention:
    """What one family's pipeline call needs beyond the shared arguments.

    - guidance_argument: the keyword the pipeline reads its guidance from (Qwen-Image: `true_cfg_scale`);
    - negative_when_guided: the negative prompt a call guided above 1 sends when it has none of its
      own (Qwen-Image's true CFG runs only with one);
    - arguments: what every call passes, None values included (Sana: `complex_human_instruction=None`);
    - default_sample_size: the latent side of the default size where the pipeline hard-codes a pixel
      size that a small VAE would make far larger (Z-Image); None: the pipeline's own;
    - input_images: how many input (reference) images a call may take (0: prompts only);
    - edit_pixels: the pixels a larger input image is scaled down to before it is encoded (None: as it is);
    - latent_patch: the side of the denoiser's latent patches (2 where latents are packed 2x2), so an
      edit made at its input image's size is a multiple of the VAE's factor times this;
    - area_argument: the keyword a pipeline that rescales any size to a pixel area reads that area
      from (FLUX.1 Kontext's `max_area`), given the decided size's height x width;
    - min_input_images: the input images a call needs (Qwen-Image-Edit cannot make an image without one);
    - input_pixels: the pixels every input image is scaled to, up or down, before it is encoded
      (Qwen-Image-Edit's megapixel), what each one costs a call; None: `edit_pixels` says;
    - one_prompt_per_call: the pipeline takes a single prompt (QwenImageEditPlusPipeline): a call of
      several is made one prompt at a time;
    - frames: a video pipeline's clip length where the caller gives none (`num_frames`; LTX-Video), its
      output the clips (`.frames`, each a list of frames); 0: an image pipeline;
    - count_argument: the keyword of the outputs per prompt (LTX-Video's `num_videos_per_prompt`);
    - fps: a video pipeline's clips play at this rate (the served MP4's, evaluate's preview);
    - frame_step: a video pipeline's clip lengths are frame_step x k + 1 (its VAE's temporal factor);
    - first_frame_pipeline: a video pipeline's diffusers class that starts a clip from an input image
      (its first frame; optimum-intel's is "OV" + it), built from the same model: a served request
      with `image` runs it (LTX-Video's LTXImageToVideoPipeline).
    """

    guidance_argument: str = "guidance_scale"
    negative_when_guided: str | None = None
    arguments: dict[str, Any] = field(default_factory=dict)
    default_sample_size: int | None = None
    input_images: int = 0
    edit_pixels: int | None = None
    latent_patch: int = 1
    area_argument: str | None = None
    min_input_images: int = 0
    input_pixels: int | None = None
    one_prompt_per_call: bool = False
    frames: int = 0
    count_argument: str = "num_images_per_prompt"
    fps: float = 0.0
    frame_step: int = 0
    first_frame_pipeline: str | None = None

    def as_config(self) -> dict[str, Any]:
        """The record as model_config stores it (plain JSON types)."""
        return asdict(self)

    @classmethod
    def from_config(cls, model_config: dict[str, Any] | None) -> CallConvention:
        """The convention a model's config records; the defaults where it records none. A key this
        record does not know is refused (a version's config and code are logged together)."""
        recorded = dict((model_config or {}).get(CONFIG_KEY) or {})
        if unknown := sorted(set(recorded) - {f.name for f in fields(cls)}):
            raise ValueError(f"model_config {CONFIG_KEY}: unknown keys {unknown}")
        return cls(**recorded)
