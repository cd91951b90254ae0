"""The denoising objective every method shares: latents, noise, timesteps, target.

Randomness (VAE posterior sample, noise, timesteps) comes from torch's global RNG, which the run
seeds once: the same seed gives the same steps, and accelerate's checkpoints restore it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def encode_latents(vae: torch.nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    """VAE posterior sample, shifted and scaled into the UNet's latent space."""
    param = next(vae.parameters())
    latents = vae.encode(pixels.to(param.device, param.dtype)).latent_dist.sample()
    shift = getattr(vae.config, "shift_factor", None) or 0.0
    return (latents - shift) * vae.config.scaling_factor


@dataclass
class NoisedBatch:
    noisy_latents: torch.Tensor
    timesteps: torch.Tensor
    target: torch.Tensor


def noise_latents(noise_scheduler, latents: torch.Tensor) -> NoisedBatch:
    """Forward diffusion at uniformly drawn timesteps, and the target the UNet must predict."""
    noise = torch.randn_like(latents)
    timesteps = torch.randint(
        0, noise_scheduler.config.num_train_timesteps, (latents.shape[0],), device=latents.device
    ).long()
    noisy = noise_scheduler.add_noise(latents, noise, timesteps)
    kind = noise_scheduler.config.prediction_type
    if kind == "epsilon":
        target = noise
    elif kind == "v_prediction":
        target = noise_scheduler.get_velocity(latents, noise, timesteps)
    else:
        raise ValueError(f"unsupported prediction type {kind!r} (use epsilon or v_prediction)")
    return NoisedBatch(noisy, timesteps, target)
