"""A family's latent codec: how pixels become the denoiser's latents, one of the roles a family is built from.

Training's x_0 is a VAE posterior sample brought into the denoiser's latent space; each family
says how its VAE takes pixels (an image, one frame of a 3D VAE, a clip) and how a sample is
scaled (the VAE config's shift and scale, per-channel statistics, FLUX.2's 2x2 patches and
batch-norm statistics). The training caches, the loss and the reference latents take the codec
as one object (`ModelFamily.codec`), never one callable at a time.

The default is SD's: images as they are, `(x - shift_factor) * scaling_factor`. A family whose
VAE differs subclasses `LatentCodec` in its own module; one that differs only in its pixel
multiple passes it:

    codec = LatentCodec(pixel_multiple=16)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LatentCodec:
    """The VAE's input and the latents' scaling of one family."""

    #: image sides must be multiples of this (the VAE's factor 8; x2 where latents are cut into 2x2
    #: patches; 32 for the deep-compression and video autoencoders)
    pixel_multiple: int = 8

    def vae_input(self, pixels: Any) -> Any:
        """A batch of images (b, c, h, w) as the VAE's encoder takes it: here unchanged."""
        return pixels

    def scale_latents(self, vae: Any, latents: Any) -> Any:
        """A VAE posterior sample in the denoiser's latent space (training's x_0): shifted and scaled
        by the VAE config's shift_factor and scaling_factor, which the pipeline undoes before decoding."""
        shift = getattr(vae.config, "shift_factor", None) or 0.0
        return (latents - shift) * vae.config.scaling_factor

