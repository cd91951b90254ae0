"""The denoising objective every method shares: latents, noise, timesteps, target, weighted loss.

Randomness (VAE posterior sample, noise, timesteps) comes from one generator per batch row,
seeded by the example the row holds (`RowRandom`, seeds from the dataset): a row's noise does not
depend on the batch size, the rank it lands on or what ran before, so 2 ranks x batch b and 1 rank
x batch 2b compute the same gradients, and a resume needs no RNG state. Without seeds (callers
outside the loop) torch's global RNG is used.

Caches: a frozen VAE gives the same posterior for the same pixels, and a frozen text encoder the
same embedding for the same prompt, so both are computed once and kept (on the CPU). The latent
cache keeps the posterior's parameters, not a sample: every step still draws a fresh sample from
the same RNG stream as without the cache, so caching changes speed, not the training.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from tasks.common.families.latent_codec import LatentCodec
from tasks.train.batch import Batch

#: SD's codec: images as they are, the VAE config's shift and scale
_DEFAULT_CODEC = LatentCodec()


class RowRandom:
    """One CPU generator per batch row (CPU: the numbers are the same on every device)."""

    def __init__(self, seeds: list[int]) -> None:
        self.generators = [torch.Generator("cpu").manual_seed(int(s)) for s in seeds]

    def randn(self, shape: tuple[int, ...], device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[rows, *shape] standard normal, row i from generator i."""
        return torch.stack([torch.randn(shape, generator=g) for g in self.generators]).to(device, dtype)

    def randint(self, high: int, device: torch.device) -> torch.Tensor:
        return torch.cat([torch.randint(0, high, (1,), generator=g) for g in self.generators]).to(device)


def _sample(dist: Any, rand: RowRandom | None) -> torch.Tensor:
    """A posterior sample: diffusers' own, or mean + std x the rows' own normal draws."""
    if rand is None:
        return dist.sample()
    return dist.mean + dist.std * rand.randn(tuple(dist.mean.shape[1:]), dist.mean.device, dist.mean.dtype)


#: a posterior's log-variance at DiagonalGaussianDistribution's floor: the point mass of a deterministic autoencoder
_POINT_LOGVAR = -30.0


def _posterior(encoded: Any) -> Any:
    """The VAE's posterior: diffusers' DiagonalGaussianDistribution, or for a deterministic autoencoder
    (an encoder output with a `latent` and no distribution, as the deep-compression autoencoder's) a
    point mass at it, whose samples are the latent itself."""
    dist = getattr(encoded, "latent_dist", None)
    return dist if dist is not None else _distribution(
        torch.cat([encoded.latent, torch.full_like(encoded.latent, _POINT_LOGVAR)], dim=1))


def _distribution(parameters: torch.Tensor) -> Any:
    """The posterior of stored parameters (mean and log-variance); a point mass stays one."""
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    point = bool((parameters.chunk(2, dim=1)[1] <= _POINT_LOGVAR).all())
    return DiagonalGaussianDistribution(parameters, deterministic=point)


def encode_latents(vae: torch.nn.Module, pixels: torch.Tensor, rand: RowRandom | None = None,
                   codec: LatentCodec = _DEFAULT_CODEC) -> torch.Tensor:
    """VAE posterior sample, brought into the denoiser's latent space by the family's `codec` (float32)."""
    param = next(vae.parameters())
    latents = _sample(_posterior(vae.encode(codec.vae_input(pixels.to(param.device, param.dtype)))), rand)
    return codec.scale_latents(vae, latents.float())


class LatentCache:
    """Posterior parameters per `latent_key` (file + crop + flip), encoded one image at a time.

    One image at a time, so a cached value never depends on which batch first needed it. `store`:
    a dict (memory) by default, or any mapping such as tasks.train.latent_store.DiskLatentStore;
    an entry holds the parameters and the crop geometry ({"parameters", "original_size",
    "crop_top_left"}). With a disk store the data loader reads the entries it finds itself and
    leaves those images undecoded (`cached_latents` in the batch; `pixels` then holds only the
    decoded rows, in order). `codec`: the family's (its VAE input and latent scaling).
    """

    def __init__(self, store: Any = None, codec: LatentCodec = _DEFAULT_CODEC) -> None:
        self.store: Any = {} if store is None else store
        self.codec = codec
        self.hits = self.misses = 0

    def latents(self, vae: torch.nn.Module, batch: Batch, rand: RowRandom | None = None) -> torch.Tensor:
        keys, pixels = batch.latent_keys, batch.pixels
        if any(k is None for k in keys):
            return encode_latents(vae, pixels, rand, self.codec)
        param = next(vae.parameters())
        given = batch.cached_latents or [None] * len(keys)
        masks = batch.masks or [None] * len(keys)
        rows, decoded = [], iter(range(pixels.shape[0]))
        for i, key in enumerate(keys):
            if given[i] is not None:  # read by the data loader, the image left undecoded
                self.hits += 1
                rows.append(given[i])
                continue
            j = next(decoded)
            if key in self.store:
                self.hits += 1
                rows.append(self.store[key]["parameters"])
                continue
            rows.append(self.encode(vae, key, pixels[j : j + 1], batch.geometry.original_sizes[i],
                                    batch.geometry.crops_top_left[i], masks[i]))
        # (`misses` counts encodings: with a disk store, entries an earlier run wrote are hits)
        stacked = torch.cat([r.to(param.device) for r in rows])
        return self.codec.scale_latents(vae, _sample(_distribution(stacked), rand))

    def parameters(self, vae: torch.nn.Module, key: str, pixels: torch.Tensor) -> torch.Tensor:
        """The posterior parameters of one image ([1, C, H, W]) under `key`: stored, else encoded and
        stored (edit training's reference images: tasks/train/references.py)."""
        entry = self.store.get(key)
        if entry is not None:
            self.hits += 1
            return entry["parameters"]
        size = torch.tensor(pixels.shape[-2:])
        return self.encode(vae, key, pixels, size, torch.zeros(2, dtype=torch.long))

    def encode(self, vae: torch.nn.Module, key: str, pixels: torch.Tensor, original_size: Any,
               crop_top_left: Any, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Encode one image ([1, C, H, W]) into the store under `key`; returns its posterior parameters.
        A subject mask ([1, H, W]) is stored beside them at the latent's size (`latent_mask`)."""
        param = next(vae.parameters())
        self.misses += 1
        dist = _posterior(vae.encode(self.codec.vae_input(pixels.to(param.device, param.dtype))))
        entry = {"parameters": dist.parameters.detach().float().cpu(),
                 "original_size": torch.as_tensor(original_size).cpu(),
                 "crop_top_left": torch.as_tensor(crop_top_left).cpu()}
        if mask is not None:
            entry["mask"] = latent_mask(mask, tuple(entry["parameters"].shape[-2:]))
        self.store[key] = entry
        return entry["parameters"]


class PromptCache:
    """(hidden states, pooled embeds) per prompt string, encoded one prompt at a time.

    `store`: a dict (memory) by default, or a mapping such as latent_store.DiskPromptStore.
    """

    def __init__(self, store: Any = None) -> None:
        self.store: Any = {} if store is None else store
        self.hits = self.misses = 0
        self.complete = False  # every prompt is in; the text encoders are gone

    def lookup(self, prompts: list[str], input_ids: list[torch.Tensor], encode: Any, device: torch.device):
        """`encode(ids_per_tokenizer) -> (hidden, pooled)`; returns the batch's (hidden, pooled)."""
        for i, prompt in enumerate(prompts):
            if prompt in self.store:
                self.hits += 1
                continue
            if self.complete:
                raise RuntimeError(f"prompt {prompt!r} is not in the text cache, and the text encoders were released")
            self.misses += 1
            hidden, pooled = encode([ids[i : i + 1] for ids in input_ids])
            self.store[prompt] = (hidden.detach().cpu(), None if pooled is None else pooled.detach().cpu())
        entries = [self.store[p] for p in prompts]
        hidden = torch.cat([e[0] for e in entries]).to(device)
        pooled_parts = [e[1] for e in entries]
        pooled = None if pooled_parts[0] is None else torch.cat(pooled_parts).to(device)  # type: ignore[arg-type]
        return hidden, pooled


@dataclass
class NoisedBatch:
    noisy_latents: torch.Tensor
    timesteps: torch.Tensor
    target: torch.Tensor
    sigmas: torch.Tensor | None = None  # flow matching's noise levels (tasks/train/objectives.py)


def noise_latents(noise_scheduler: Any, latents: torch.Tensor, noise_offset: float = 0.0,
                  rand: RowRandom | None = None) -> NoisedBatch:
    """Forward diffusion at uniformly drawn timesteps, and the target the UNet must predict.

    `noise_offset` adds per-channel constant noise (diffusers' --noise_offset), which lets the model
    learn overall brightness shifts. `rand`: per-row generators (else the global RNG).
    """
    steps = noise_scheduler.config.num_train_timesteps
    if rand is not None:
        noise = rand.randn(tuple(latents.shape[1:]), latents.device, latents.dtype)
        if noise_offset:
            noise = noise + noise_offset * rand.randn((latents.shape[1], 1, 1), latents.device, latents.dtype)
        timesteps = rand.randint(steps, latents.device).long()
    else:
        noise = torch.randn_like(latents)
        if noise_offset:
            noise = noise + noise_offset * torch.randn((latents.shape[0], latents.shape[1], 1, 1),
                                                       device=latents.device)
        timesteps = torch.randint(0, steps, (latents.shape[0],), device=latents.device).long()
    noisy = noise_scheduler.add_noise(latents, noise, timesteps)
    kind = noise_scheduler.config.prediction_type
    if kind == "epsilon":
        target = noise
    elif kind == "v_prediction":
        target = noise_scheduler.get_velocity(latents, noise, timesteps)
    else:
        raise ValueError(f"unsupported prediction type {kind!r} (use epsilon or v_prediction)")
    return NoisedBatch(noisy, timesteps, target)


def latent_mask(mask: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """A [1, H, W] (or [1, h', w']) mask brought to `size` by area averaging: [1, h, w], float32.

    Area interpolation keeps each latent pixel's weight the share of its pixels that are subject."""
    mask = mask.float()
    if tuple(mask.shape[-2:]) == tuple(size):
        return mask.reshape(1, *size)
    return F.interpolate(mask.reshape(1, 1, *mask.shape[-2:]), size=size, mode="area")[0]


@dataclass(frozen=True)
class LossWeights:
    """Per-element loss weights from subject masks: [B, 1, h, w] on the prediction's (unpacked) grid."""

    weights: torch.Tensor
    normalize: bool = False  # divide each example's loss by its mean weight (normalize_masked_area_loss)

    def mean(self, err: torch.Tensor) -> torch.Tensor:
        """Per-example mean of `err` ([B, C, h, w]) weighted by the masks."""
        w = self.weights.to(err.device, err.dtype)
        dims = list(range(1, err.ndim))
        loss = (err * w).mean(dim=dims)
        if self.normalize:
            loss = loss / w.mean(dim=dims).clamp_min(1e-6)
        return loss


def per_example_loss(
    pred: torch.Tensor, target: torch.Tensor, timesteps: torch.Tensor, noise_scheduler: Any, snr_gamma: float | None,
    weights: LossWeights | None = None,
) -> torch.Tensor:
    """MSE per example (float32), Min-SNR weighted when `snr_gamma` is set (Hang et al. 2023).

    The weight is min(SNR, gamma) / SNR for epsilon and min(SNR, gamma) / (SNR + 1) for
    v-prediction, with SNR from diffusers' compute_snr, as in train_text_to_image.py. `weights`:
    the subject masks' per-element weights (masked_loss).
    """
    err = F.mse_loss(pred.float(), target.float(), reduction="none")
    loss = weights.mean(err) if weights is not None else err.mean(dim=list(range(1, pred.ndim)))
    if snr_gamma is None:
        return loss
    from diffusers.training_utils import compute_snr

    snr = compute_snr(noise_scheduler, timesteps)
    weights = torch.clamp(snr, max=snr_gamma)
    if noise_scheduler.config.prediction_type == "v_prediction":
        weights = weights / (snr + 1)
    else:
        weights = weights / snr
    return loss * weights
