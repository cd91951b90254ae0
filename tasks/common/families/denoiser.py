"""A family's denoiser: how its UNet or transformer is loaded, trained and called, one of the roles a
family is built from.

The denoiser's folder in the pipeline, the training objective it was made for (the name of one of
tasks/train/objectives.py's OBJECTIVES, with the settings the family gives it and the schedule it
draws from), where LoRA goes on it, how it is called on noisy latents (`predict`), the starting
noise its pipeline takes (`latent_shape`), whether classifier-free guidance doubles its batch, and
the train.* options its objective has no use for. Training, the export's parity run, evaluate and
the quantized base take the denoiser as one object (`ModelFamily.denoiser`).

A family writes its call as a subclass in its own module; the flow-matching families share
`FlowDenoiser` (flow.py), FLUX.1 Kontext FLUX.1's with its reference tokens added.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: train.* keys only a flow-matching objective reads
FLOW_OPTIONS = ("weighting_scheme", "logit_mean", "logit_std", "mode_scale", "max_sequence_length",
                "timestep_sampling", "sigmoid_scale", "timestep_shift")


@dataclass(frozen=True)
class Geometry:
    """Where each row's pixels came from, (n, 2) long tensors: the source image's size, the crop's
    top-left corner and the size trained at (the row's bucket). Every row has one; SDXL's
    micro-conditioning reads it, the latent cache keys a crop by it."""

    original_sizes: Any
    crops_top_left: Any
    target_sizes: Any

    def to(self, device: Any, non_blocking: bool = False) -> Geometry:
        return Geometry(*(t.to(device, non_blocking=non_blocking) for t in
                          (self.original_sizes, self.crops_top_left, self.target_sizes)))


@dataclass(frozen=True)
class PredictInputs:
    """What a denoiser call (`Denoiser.predict`) reads beyond the noisy latents, the timesteps and the
    prompt embeddings."""

    #: train.resolution (SDXL's target size where a row has none)
    resolution: int
    #: the guidance input of guidance-distilled bases (FLUX); others have none
    guidance_scale: float
    #: where each row's pixels came from (a `Geometry`), which SDXL's micro-conditioning reads; None
    #: where a caller has none
    geometry: Geometry | None = None
    #: edit training: the scaled latents of each reference image ([n, C, h, w] per reference), or None
    references: Any = None


@dataclass(frozen=True)
class Denoiser:
    """The denoiser of one family (the defaults are SD's: a UNet trained on DDPM noise)."""

    #: its folder in the pipeline ("unet" or "transformer"), which methods and checkpoints call it by
    name: str = "unet"
    #: "ddpm" (noise or v prediction on a DDPM schedule) or "flow_matching" (rectified flow)
    objective: str = "ddpm"
    #: peft target modules of its attention projections (the text encoders': `text.lora_targets`)
    lora_targets: tuple[str, ...] = ("to_k", "to_q", "to_v", "to_out.0")
    #: classifier-free guidance runs it on a doubled batch (FLUX.1's distilled guidance does not)
    guidance_in_batch: bool = True
    #: train.guidance_scale is one of its inputs (guidance-distilled FLUX bases); elsewhere refused
    takes_guidance_scale: bool = False
    #: train.launcher xla (PyTorch/XLA SPMD) has been run on this denoiser (its checkpointing and sharding)
    xla_tested: bool = True
    #: train.weighting_scheme where the config leaves it null (what diffusers' script for the family
    #: defaults to); None: the objective has no weighting (DDPM)
    weighting_scheme: str | None = None
    #: the family's title, for messages (ModelFamily sets it)
    title: str = "this model family"

    def load(self, base: Path, dtype: Any = None, quantize: Any = None) -> Any:
        """The denoiser of a base folder, in the precision diffusers loads it in, or in `dtype` (a
        frozen denoiser: loaded tensor by tensor, never the whole file beside it); `quantize`: a frozen
        denoiser's Linear layers quantized as they load."""
        import json

        import diffusers
        import torch

        index = json.loads((Path(base) / "model_index.json").read_text())
        model_class = getattr(diffusers, index[self.name][1])
        if dtype is None and quantize is None:
            return model_class.from_pretrained(base, subfolder=self.name)
        from tasks.common.weights_load import load_in_dtype

        return load_in_dtype(model_class, base, self.name, dtype or torch.float32, quantize)

    def noise_scheduler(self, base: Path, prediction_type: str | None) -> Any:
        """The scheduler training draws timesteps and noise levels from: DDPM with the base's betas,
        optionally with another prediction target."""
        from diffusers import DDPMScheduler

        scheduler = DDPMScheduler.from_pretrained(base, subfolder="scheduler")
        if prediction_type is not None:
            scheduler.register_to_config(prediction_type=prediction_type)
        return scheduler

    def objective_options(self) -> dict[str, Any]:
        """The objective's own train.* settings, with the value this family gives each where the config
        leaves it null (flow matching: `weighting_scheme`); DDPM has none."""
        return {} if self.weighting_scheme is None else {"weighting_scheme": self.weighting_scheme}

    def refused_options(self) -> dict[str, str]:
        """train.* keys this objective and call have no use for (key: why): the flow-matching ones, and
        the guidance input where the denoiser takes none."""
        why = f"a flow-matching option (SD3, FLUX); {self.title} trains with DDPM noise"
        return {**dict.fromkeys(FLOW_OPTIONS, why), **self.guidance_refusal()}

    def guidance_refusal(self) -> dict[str, str]:
        if self.takes_guidance_scale:
            return {}
        return {"guidance_scale": f"the guidance input of guidance-distilled FLUX bases; {self.title} has none"}

    def predict(self, denoiser: Any, noisy_latents: Any, timesteps: Any, hidden: Any, pooled: Any,
                inputs: PredictInputs) -> Any:
        """The denoiser's prediction, in the latents' shape."""
        raise NotImplementedError

    def latent_shape(self, pipe: Any, height: int, width: int) -> tuple[int, ...]:
        """One image's starting noise as the pipeline's `latents` argument takes it (no batch axis)."""
        channels = int(getattr(pipe, self.name).config["in_channels"])
        vsf = int(pipe.vae_scale_factor)
        return (channels, height // vsf, width // vsf)
