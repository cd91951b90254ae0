"""The training objective a model family declares (`family.denoiser.objective`, the name of one of OBJECTIVES,
built with the denoiser's `objective_options()`): what noise is added at which level, and the loss on
the denoiser's prediction.

- `ddpm` (SD 1.x/2.x, SDXL): tasks/train/diffusion.py's noise_latents and per_example_loss (noise or
  v prediction, offset noise, Min-SNR), unchanged.
- `flow_matching` (SD3/3.5, FLUX.1), as diffusers' train_dreambooth*_sd3/flux.py compute it: u from
  `compute_density_for_timestep_sampling(weighting_scheme, logit_mean, logit_std, mode_scale)`,
  timesteps and sigmas of the base's FlowMatchEulerDiscreteScheduler at index u x 1000,
  x_t = (1 - sigma) x_0 + sigma noise, target noise - x_0, loss weighted by
  `compute_loss_weighting_for_sd3(weighting_scheme, sigma)`.
  `timestep_sampling` (uniform, sigmoid, logit_normal: ai-toolkit's, SimpleTuner's and kohya's
  names) replaces the scheme's density; `timestep_shift` replaces the base scheduler's shift:
  sigma = e^mu / (e^mu + 1/t - 1) on the unshifted grid t, with mu = log(shift), or for `auto`
  FLUX's `calculate_shift` of the image's token count (diffusers' FlowMatchEulerDiscreteScheduler
  `time_shift`, exponential), so larger images train at noisier levels.

Both draw every random number per batch row from the row's own generator (`RowRandom`), so a row's
noise does not depend on the batch it is in, the rank or the step it resumes from.

First-frame conditioning (`first_frame_conditioning_p`, video families; `FirstFrame`): a share of the
clips trains as image-to-video, as LTXImageToVideoPipeline runs the model: the first latent frame
stays clean in the noisy input, its tokens get timestep 0, and it is left out of the loss.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
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
        scheme, mean, std = self.scheme, cfg.logit_mean, cfg.logit_std
        if cfg.timestep_sampling is not None:  # sigmoid(scale N(0, 1)) is logit-normal with mean 0, std scale
            scheme = {"uniform": "none", "logit_normal": "logit_normal", "sigmoid": "logit_normal"}[
                cfg.timestep_sampling]
            mean, std = (0.0, cfg.sigmoid_scale) if cfg.timestep_sampling == "sigmoid" else (mean, std)
        kwargs = dict(logit_mean=mean, logit_std=std, mode_scale=cfg.mode_scale)
        if rand is None:
            return compute_density_for_timestep_sampling(scheme, n, **kwargs)
        return torch.cat([compute_density_for_timestep_sampling(scheme, 1, generator=g, **kwargs)
                          for g in rand.generators])

    def sigmas(self, u: torch.Tensor, latent_hw: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Timesteps and sigmas for draws `u` in [0, 1): the base scheduler's (its shift), or with
        `timestep_shift` the unshifted grid shifted by it (`auto`: by the latents' token count)."""
        steps = self.scheduler.config.num_train_timesteps
        indices = (u * steps).long().clamp(max=steps - 1)
        if self.cfg.timestep_shift is None:
            return self.scheduler.timesteps[indices], self.scheduler.sigmas[indices]
        unshifted = 1.0 - indices.double() / steps  # the scheduler's grid with shift 1
        mu = self._mu(latent_hw)
        sigmas = (math.exp(mu) / (math.exp(mu) + 1.0 / unshifted - 1.0)).float()
        return sigmas * steps, sigmas

    def _mu(self, latent_hw: tuple[int, int]) -> float:
        shift = self.cfg.timestep_shift
        if shift != "auto":
            return math.log(float(shift))
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        config = self.scheduler.config
        tokens = (latent_hw[0] // 2) * (latent_hw[1] // 2)  # 2x2 latent patches (SD3, FLUX's packing)
        return calculate_shift(tokens, config.base_image_seq_len, config.max_image_seq_len, config.base_shift,
                               config.max_shift)

    def noise(self, latents: torch.Tensor, rand: RowRandom | None) -> NoisedBatch:
        n = latents.shape[0]
        timesteps, sigmas = self.sigmas(self._u(n, rand), tuple(latents.shape[-2:]))
        timesteps = timesteps.to(latents.device)
        sigmas = sigmas.to(latents.device, latents.dtype).reshape(n, *([1] * (latents.ndim - 1)))
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


@dataclass(frozen=True)
class FirstFrame:
    """Image-to-video conditioning of one batch of clip latents (b, C, f, h, w): `rows` (bool, (b,)) are
    the clips whose first latent frame is the given condition, as LTXImageToVideoPipeline treats it."""

    rows: torch.Tensor

    @classmethod
    def draw(cls, p: float, latents: torch.Tensor, rand: RowRandom | None) -> FirstFrame | None:
        """Each row conditioned with chance `p`, drawn from the row's own generator after every other draw
        of the step (so its noise is as without conditioning). None, with nothing drawn, when `p` is 0 (the
        rows' streams and the step exactly as without the option), when the latents are not clips of two
        or more latent frames, or when no row is drawn."""
        if not p or latents.ndim != 5 or latents.shape[2] < 2:
            return None
        if rand is None:
            draws = torch.rand(latents.shape[0])
        else:
            draws = torch.cat([torch.rand(1, generator=g) for g in rand.generators])
        picked = draws < p  # decided on the CPU: no device sync per step
        return cls(picked.to(latents.device)) if bool(picked.any()) else None

    def noise(self, noised: NoisedBatch, latents: torch.Tensor) -> NoisedBatch:
        """The conditioned rows' first latent frame clean in the noisy input, and the timesteps per latent
        frame ((b, f): the row's on every frame, 0 on a conditioned row's first), which the family's
        `predict` spreads over each frame's tokens (the pipeline's `timestep * (1 - conditioning_mask)`)."""
        keep = self.rows.view(-1, 1, 1, 1, 1)
        noisy = noised.noisy_latents.clone()
        noisy[:, :, :1] = torch.where(keep, latents[:, :, :1].to(noisy.dtype), noisy[:, :, :1])
        timesteps = noised.timesteps.reshape(-1, 1).repeat(1, latents.shape[2])
        timesteps[:, 0] = torch.where(self.rows, torch.zeros_like(timesteps[:, 0]), timesteps[:, 0])
        return replace(noised, noisy_latents=noisy, timesteps=timesteps)

    def weights(self, masks: LossWeights | None, pred: torch.Tensor) -> LossWeights:
        """The loss weights with the conditioned rows' first latent frame at 0 and their other f - 1
        frames at f / (f - 1), so each row's loss is the mean over the frames that count (a conditioned
        clip's frames 1.., every other clip's all frames); any subject-mask weights multiply in, with
        their own normalize_masked_area_loss."""
        f = pred.shape[2]
        frames = torch.ones(pred.shape[0], 1, f, 1, 1, device=pred.device)
        rows = self.rows.to(pred.device)
        frames[rows] = f / (f - 1)
        frames[rows, :, 0] = 0.0
        if masks is None:
            return LossWeights(frames)
        return LossWeights(frames * masks.weights.to(pred.device).unsqueeze(2), normalize=masks.normalize)


#: Every objective, by the name a family's `denoiser.objective` gives.
OBJECTIVES: dict[str, type[Ddpm] | type[FlowMatching]] = {o.name: o for o in (Ddpm, FlowMatching)}


def make_objective(family: Any, scheduler: Any, cfg: Any) -> Ddpm | FlowMatching:
    """The family's objective on `scheduler`, with `cfg`'s settings (the family's where they are null)."""
    denoiser = family.denoiser
    if denoiser.objective not in OBJECTIVES:
        raise ValueError(f"{family.title}: unknown objective {denoiser.objective!r}; known: {', '.join(OBJECTIVES)}")
    return OBJECTIVES[denoiser.objective](scheduler, cfg, denoiser.objective_options())
