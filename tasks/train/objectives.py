"""The training objective a model family declares (`family.objective`, the name of one of OBJECTIVES,
built with the family's `objective_options()`): what noise is added at which level, and the loss on
the denoiser's prediction.

- `ddpm` (SD 1.x/2.x, SDXL): tasks/train/diffusion.py's noise_latents and per_example_loss (noise or
  v prediction, offset noise, Min-SNR), unchanged.
- `flow_matching` (SD3/3.5, FLUX.1), as diffusers' train_dreambooth*_sd3/flux.py compute it: u from
  `compute_density_for_timestep_sampling(weighting_scheme, logit_mean, logit_std, mode_scale)`,
  timesteps and sigmas of the base's FlowMatchEulerDiscreteScheduler at index u x 1000,
  x_t = (1 - sigma) x_0 + sigma noise, target noise - x_0, loss weighted by
  `compute_loss_weighting_for_sd3(weighting_scheme, sigma)`.

Both draw every random number per batch row from the row's own generator (`RowRandom`), so a row's
noise does not depend on the batch it is in, the rank or the step it resumes from.
"""
from __future__ import annotations

from typing import Any

import torch

from tasks.train.diffusion import LossWeights, NoisedBatch, RowRandom, noise_latents, per_example_loss


class Ddpm:
    name = "ddpm"

    def __init__(self, scheduler: Any, cfg: Any, options: dict[str, Any]) -> None:
        self.scheduler, self.cfg = scheduler, cfg

    def noise(self, latents: torch.Tensor, rand: RowRandom | None) -> NoisedBatch:
        return noise_latents(self.scheduler, latents, self.cfg.noise_offset, rand)

    def loss(self, pred: torch.Tensor, noised: NoisedBatch, weights: LossWeights | None = None) -> torch.Tensor:
        return per_example_loss(pred, noised.target, noised.timesteps, self.scheduler, self.cfg.snr_gamma, weights)


class FlowMatching:
    name = "flow_matching"

    def __init__(self, scheduler: Any, cfg: Any, options: dict[str, Any]) -> None:
        self.scheduler, self.cfg = scheduler, cfg
        self.scheme = cfg.weighting_scheme or options["weighting_scheme"]  # the family's when null

    def _u(self, n: int, rand: RowRandom | None) -> torch.Tensor:
        from diffusers.training_utils import compute_density_for_timestep_sampling

        cfg = self.cfg
        kwargs = dict(logit_mean=cfg.logit_mean, logit_std=cfg.logit_std, mode_scale=cfg.mode_scale)
        if rand is None:
            return compute_density_for_timestep_sampling(self.scheme, n, **kwargs)
        return torch.cat([compute_density_for_timestep_sampling(self.scheme, 1, generator=g, **kwargs)
                          for g in rand.generators])

    def noise(self, latents: torch.Tensor, rand: RowRandom | None) -> NoisedBatch:
        n = latents.shape[0]
        steps = self.scheduler.config.num_train_timesteps
        indices = (self._u(n, rand) * steps).long().clamp(max=steps - 1)
        timesteps = self.scheduler.timesteps[indices].to(latents.device)
        sigmas = self.scheduler.sigmas[indices].to(latents.device, latents.dtype)
        sigmas = sigmas.reshape(n, *([1] * (latents.ndim - 1)))
        noise = (rand.randn(tuple(latents.shape[1:]), latents.device, latents.dtype) if rand is not None
                 else torch.randn_like(latents))
        noisy = (1.0 - sigmas) * latents + sigmas * noise
        return NoisedBatch(noisy, timesteps, noise - latents, sigmas)

    def loss(self, pred: torch.Tensor, noised: NoisedBatch, weights: LossWeights | None = None) -> torch.Tensor:
        """Per example; `weights`: the subject masks on the unpacked latent grid (families unpack
        FLUX's 2x2 tokens in `predict`, so the mask lies on the prediction as on the image)."""
        from diffusers.training_utils import compute_loss_weighting_for_sd3

        weighting = compute_loss_weighting_for_sd3(self.scheme, noised.sigmas).float()
        err = weighting * (pred.float() - noised.target.float()) ** 2
        if weights is not None:
            return weights.mean(err)
        return err.reshape(err.shape[0], -1).mean(dim=1)


#: Every objective, by the name a family's `objective` gives.
OBJECTIVES: dict[str, type[Ddpm] | type[FlowMatching]] = {o.name: o for o in (Ddpm, FlowMatching)}


def make_objective(family: Any, scheduler: Any, cfg: Any) -> Ddpm | FlowMatching:
    """The family's objective on `scheduler`, with `cfg`'s settings (the family's where they are null)."""
    if family.objective not in OBJECTIVES:
        raise ValueError(f"{family.title}: unknown objective {family.objective!r}; known: {', '.join(OBJECTIVES)}")
    return OBJECTIVES[family.objective](scheduler, cfg, family.objective_options())
