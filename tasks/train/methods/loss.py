"""One micro-batch's loss: latents (cached or encoded), noise from the objective (a video family's
first-frame conditioning), conditioning (cached or encoded), the family's denoiser call, masks and
concept weights, prior preservation.
A mixin of TrainingMethod."""
from __future__ import annotations

import torch

from tasks.train.batch import Batch
from tasks.train.concepts import weighted
from tasks.train.diffusion import RowRandom, encode_latents
from tasks.train.masks import loss_weights
from tasks.train.objectives import FirstFrame
from tasks.train.references import reference_latents


class Loss:
    """compute_loss and what a step counts (`components`, `objective` and the caches are TrainingMethod's)."""

    def compute_loss(
        self, batch: Batch, modules: dict[str, torch.nn.Module]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(loss to backpropagate, extra scalars to log, as 0-d tensors) for one micro-batch."""
        c, cfg = self.components, self.cfg
        rand = RowRandom(batch.noise_seeds)  # per example, any rank
        with torch.no_grad():
            if self.latent_cache is not None:
                latents = self.latent_cache.latents(modules["vae"], batch, rand)
            else:
                latents = encode_latents(modules["vae"], batch.pixels, rand, c.family.codec)
            references = reference_latents(modules["vae"], batch.references, self.latent_cache, c.family)
        noised = self.objective.noise(latents, rand)
        first = FirstFrame.draw(cfg.first_frame_conditioning_p, latents, rand)  # video: image-to-video rows
        if first is not None:
            noised = first.noise(noised, latents)
        family = c.family
        encoders = [modules[n] for n in c.text_encoder_names()]
        if self.prompt_cache is not None:
            with torch.no_grad():
                hidden, pooled = self.prompt_cache.lookup(
                    batch.prompts, batch.input_ids, lambda ids: family.text.encode_prompt(c, ids, encoders),
                    latents.device)
        else:
            pixels = batch.references.pixels if batch.references is not None else None
            hidden, pooled = family.text.encode_batch_text(c, batch.prompts, batch.input_ids, encoders, pixels)
        sample = noised.noisy_latents
        if cfg.channels_last:
            sample = sample.contiguous(memory_format=torch.channels_last)
        denoiser = family.denoiser
        pred = denoiser.predict(modules[denoiser.name], sample, noised.timesteps, hidden, pooled,
                                batch.predict_inputs(cfg.resolution, cfg.guidance_scale, references))
        weights = loss_weights(cfg, batch.masks, batch.mask_off, pred)
        if first is not None:
            weights = first.weights(weights, pred)  # the conditioned rows' first latent frame out of the loss
        losses = self.objective.loss(pred, noised, weights)
        losses = weighted(losses, batch, self.concepts_seen)  # each row's concept weight; examples counted
        n = batch.num_instances
        if n == losses.shape[0]:
            loss = losses.mean()
            return loss, {"instance_loss": loss.detach()}  # read after the step (XLA: no extra sync)
        instance_loss, prior_loss = losses[:n].mean(), losses[n:].mean()
        loss = instance_loss + cfg.prior_loss_weight * prior_loss
        return loss, {"instance_loss": instance_loss.detach(), "prior_loss": prior_loss.detach()}

    def images_in(self, batch: Batch) -> int:
        """Images one micro-batch pushes through the denoiser (for images/s)."""
        return len(batch.latent_keys)
