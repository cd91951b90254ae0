"""What the flow-matching transformer families (SD3/SD3.5, FLUX.1) share.

Rectified flow: x_t = (1 - sigma) x_0 + sigma noise, the transformer predicts the velocity
noise - x_0; sigmas come from the base's FlowMatchEulerDiscreteScheduler (with its shift), drawn
with diffusers' `compute_density_for_timestep_sampling` (train.weighting_scheme). No DDPM options
(prediction_type, snr_gamma, noise_offset) and no textual inversion: diffusers' SD3 and FLUX
scripts have none, and their T5 encoder would need its own embedding file format.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.common.families.base import ModelFamily
from tasks.common.families.denoiser import Denoiser
from tasks.common.families.export_profile import ExportProfile
from tasks.common.families.latent_codec import LatentCodec

_NOT_FLOW = "is a DDPM option; {title} trains with flow matching (train.weighting_scheme and its logit_* / mode_scale)"


@dataclass(frozen=True)
class FlowDenoiser(Denoiser):
    """A rectified-flow transformer: the base's FlowMatchEulerDiscreteScheduler, the DDPM options refused."""

    name: str = "transformer"
    objective: str = "flow_matching"
    takes_guidance_scale: bool = True
    weighting_scheme: str | None = "none"
    xla_tested: bool = False  # the XLA back end's checkpointing and sharding were built and run for UNets

    def noise_scheduler(self, base: Path, prediction_type: str | None) -> Any:
        from diffusers import FlowMatchEulerDiscreteScheduler

        return FlowMatchEulerDiscreteScheduler.from_pretrained(base, subfolder="scheduler")

    def refused_options(self) -> dict[str, str]:
        why = _NOT_FLOW.format(title=self.title)
        return {"prediction_type": why, "snr_gamma": why, "noise_offset": why, **self.guidance_refusal()}


class FlowMatchingFamily(ModelFamily):
    denoiser = FlowDenoiser()  # a family replaces it with its own subclass (its `predict`)
    # ComfyUI: its own key names under `diffusion_model.` (Z-Image, Qwen-Image read diffusers' module
    # paths there); LyCORIS' `lycoris_<path>` for LoKr and LoHa (comfy/lora.py maps both)
    export = ExportProfile(ov_pipeline=None, comfyui_lora_prefixes={"transformer": "diffusion_model."},
                           comfyui_lycoris_prefixes={"transformer": "lycoris_"})
    codec = LatentCodec(pixel_multiple=16)  # SD3's patch size 2, FLUX's 2x2 packing: even latent sides


def flow_scheduler(shift: float = 3.0, dynamic: bool = False) -> Any:
    from diffusers import FlowMatchEulerDiscreteScheduler

    if dynamic:
        return FlowMatchEulerDiscreteScheduler(shift=shift, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                               base_image_seq_len=256, max_image_seq_len=4096)
    return FlowMatchEulerDiscreteScheduler(shift=shift)
