"""How long, and what each step draws: steps, accumulation, the learning-rate schedule, the seed,
the training target and noise, the flow-matching timestep density (diffusers' names), and a video
family's first-frame (image-to-video) conditioning."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from tasks.common.config import StageConfig

LR_SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts", "polynomial")


class ScheduleSection(StageConfig):
    max_train_steps: int = Field(20, ge=1, description="optimizer steps")
    gradient_accumulation_steps: int = Field(1, ge=1, le=1024, description="batches per optimizer step")
    lr_scheduler: Literal[LR_SCHEDULERS] = Field("constant", description="learning-rate schedule")  # type: ignore[valid-type]
    lr_warmup_steps: int = Field(0, ge=0, description="optimizer steps of linear warm-up from 0")
    lr_num_cycles: int = Field(1, ge=1, description="restarts of cosine_with_restarts")
    lr_power: float = Field(1.0, gt=0.0, description="power of the polynomial schedule")
    seed: int = Field(0, ge=0, description="same seed and params give the same weights")
    # the target and its noise (DDPM families)
    prediction_type: Literal["epsilon", "v_prediction"] | None = Field(
        None, description="training target; null: the base model's scheduler setting"
    )
    snr_gamma: float | None = Field(None, gt=0.0, description="Min-SNR loss weighting (5.0 recommended); null: off")
    noise_offset: float = Field(0.0, ge=0.0, le=1.0, description="offset noise scale (0.05-0.1 typical)")
    # flow matching (SD3/3.5, FLUX; the names of diffusers' train_dreambooth*_sd3/flux.py)
    weighting_scheme: Literal["none", "sigma_sqrt", "logit_normal", "mode", "cosmap"] | None = Field(
        None, description="timestep density and loss weighting; null: the family's (SD3 logit_normal, FLUX none)"
    )
    logit_mean: float = Field(0.0, description="mean of the logit_normal weighting scheme")
    logit_std: float = Field(1.0, gt=0.0, description="std of the logit_normal weighting scheme")
    mode_scale: float = Field(1.29, description="scale of the mode weighting scheme")
    timestep_sampling: Literal["uniform", "sigmoid", "logit_normal"] | None = Field(
        None, description="timestep density (ai-toolkit's, SimpleTuner's names); null: weighting_scheme's. "
                          "weighting_scheme then weights the loss only")
    sigmoid_scale: float = Field(1.0, gt=0.0, description="timestep_sampling sigmoid: sigmoid(scale x N(0, 1))")
    timestep_shift: float | Literal["auto"] | None = Field(
        None, description="shift of the sampled sigmas (SD3: 3.0; above 1: noisier); auto: FLUX's "
                          "resolution-dependent shift; null: the base scheduler's")
    # image-to-video conditioning (video families; LTX-Video-Trainer's name)
    first_frame_conditioning_p: float = Field(
        0.0, ge=0.0, le=1.0, description="video families: chance that a clip trains as image-to-video (its first "
        "latent frame kept clean, at timestep 0 and out of the loss, as LTXImageToVideoPipeline runs it), drawn "
        "per clip and step; 0: every clip trains as text-to-video")
    guidance_scale: float = Field(3.5, ge=0.0, description="FLUX guidance-distilled bases: the guidance input")
    max_sequence_length: int | None = Field(
        None, ge=1, le=512, description="T5 tokens per prompt; null: the family's (SD3 77, FLUX 512), at most "
                                        "the tokenizer's"
    )

    def _schedule_problem(self) -> str | None:
        if self.lr_warmup_steps > self.max_train_steps:
            return "lr_warmup_steps is larger than max_train_steps"
        if isinstance(self.timestep_shift, float) and self.timestep_shift <= 0:
            return f"timestep_shift must be above 0 (got {self.timestep_shift}); 1.0 shifts nothing, or use auto"
        if self.timestep_sampling and self.weighting_scheme in ("logit_normal", "mode"):
            return (f"timestep_sampling: {self.timestep_sampling} and weighting_scheme: {self.weighting_scheme} both "
                    "choose the timestep density: set weighting_scheme: none (or sigma_sqrt / cosmap, which only "
                    "weight the loss), or timestep_sampling: null")
        return None
