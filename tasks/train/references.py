"""Edit training: each target's reference images, through its geometry and into the denoiser's input.

The ingest stage writes each reference at its processed target's size (tasks/ingest/references.py).
Here a reference gets exactly what its target gets at training time (the bucket's cover resize, the
crop corner, the flip), as diffusers' train_dreambooth_lora_flux2_klein_img2img.py transforms the
condition image with its target, so the pair stays aligned. Its latent is the VAE posterior's mode
(Flux2KleinPipeline encodes image inputs with sample_mode="argmax"), scaled as the family scales
latents; it is not noised: the family puts the reference tokens beside the noisy target tokens.

Cached like the targets' latents: with fixed crops (`center_crop`) a reference's posterior is kept
in the latent cache (memory or disk) under its own key (its file's SHA-256, its target's size, crop
source size and flip), filled by the caching pass before the first step (fill_references).
"""
from __future__ import annotations

import hashlib
import io
from typing import Any

import numpy as np
import torch
from PIL import Image

from tasks.common.errors import UserError
from tasks.common.images import apply_exif_orientation, cover_size, follow_geometry, to_rgb
from tasks.train.batch import ReferenceImages


def prepare_reference(image: Image.Image, original: tuple[int, int], target: tuple[int, int],
                      crop: tuple[int, int], flip: bool) -> torch.Tensor:
    """A reference through its target's `prepare_image` geometry -> CHW in [-1, 1].

    `original`, `crop`: what prepare_image returned for the target (a reference of another size is
    first stretched onto the target's)."""
    image = follow_geometry(to_rgb(apply_exif_orientation(image)), original, target, crop, flip)
    array = np.asarray(image, dtype=np.float32) / 127.5 - 1.0
    return torch.from_numpy(array).permute(2, 0, 1).contiguous()


def load_references(record: Any, original: tuple[int, int], target: tuple[int, int], crop: tuple[int, int],
                    flip: bool, fixed: bool) -> dict[str, Any]:
    """{"references": [CHW per reference], "reference_keys": [latent key, or None with random crops]}."""
    pixels, keys = [], []
    for path in record.references:
        data = path.read_bytes()
        with Image.open(io.BytesIO(data)) as im:
            pixels.append(prepare_reference(im, original, target, crop, flip))
        digest = hashlib.sha256(data).hexdigest()
        keys.append(f"ref:{digest}:{target[0]}x{target[1]}:{int(flip)}:on={original[0]}x{original[1]}:"
                    f"at={crop[0]},{crop[1]}" if fixed else None)
    return {"references": pixels, "reference_keys": keys}


def fill_references(cache: Any, vae: torch.nn.Module, record: Any, target: tuple[int, int], flip: bool,
                    family: Any) -> None:
    """Put a centre-cropped target's references into the latent cache (the caching pass before the
    first step), under the keys its examples will look up."""

    original = record.image_size()
    width, height = cover_size(original, target)
    crop = ((height - target[0]) // 2, (width - target[1]) // 2)
    refs = load_references(record, original, target, crop, flip, fixed=True)
    for pixels, key in zip(refs["references"], refs["reference_keys"]):
        cache.parameters(vae, key, family.inputs.pixels(pixels[None]))


def stack_references(parts: list[dict[str, Any]]) -> ReferenceImages | None:
    """Per reference index j, the rows' j-th references stacked ([n, 3, H, W]) and their keys; None without."""
    counts = {len(p.get("references") or ()) for p in parts}
    if counts == {0}:
        return None
    if len(counts) > 1:
        raise RuntimeError(f"a batch mixes targets with {sorted(counts)} reference images (see batch_groups)")
    (count,) = counts
    pixels = [torch.stack([p["references"][j] for p in parts]) for j in range(count)]
    keys = [[p["reference_keys"][j] for p in parts] for j in range(count)]
    return ReferenceImages(pixels, keys)


def reference_latents(vae: torch.nn.Module, references: ReferenceImages | None, cache: Any,
                      family: Any) -> list[torch.Tensor] | None:
    """The scaled latents of each reference index ([n, C, h, w] each): the posterior's mode, from the
    latent cache where the key is there (else encoded, and kept there), as the target's latents; a
    reference encoded as the family's pipeline encodes an input image (`inputs.pixels`)."""
    from tasks.train.diffusion import _distribution, _posterior

    if references is None or not references.pixels:
        return None
    param = next(vae.parameters())
    out = []
    for j, batch_pixels in enumerate(references.pixels):
        rows = []
        for i in range(batch_pixels.shape[0]):
            key = references.keys[j][i]
            one = batch_pixels[i : i + 1]
            if cache is not None and key is not None:
                rows.append(cache.parameters(vae, key, one if key in cache.store else family.inputs.pixels(one)))
            else:
                one = family.inputs.pixels(one).to(param.device, param.dtype)
                rows.append(_posterior(vae.encode(family.codec.vae_input(one))).parameters.float())
        stacked = torch.cat([r.to(param.device) for r in rows])
        out.append(family.codec.scale_latents(vae, _distribution(stacked).mode().float()))
    return out


def refuse_reference_settings(cfg: Any, records: list[Any]) -> None:
    """What edit training cannot do here, refused before any load: class images (they have no
    references). Targets with different numbers of references train in batches of one count each
    (TrainDataset.batch_groups: one batch is one token sequence length)."""
    if not any(r.references for r in records):
        return
    if cfg.with_prior_preservation:
        raise UserError("train.with_prior_preservation: class images have no reference images, so prior "
                        "preservation cannot train beside an edit dataset (metadata.jsonl `reference_file_names`); "
                        "set train.with_prior_preservation: false.")


def refuse_references(family: Any, records: list[Any]) -> None:
    """Reference images (an edit dataset) train only on a family that takes them: refused before any load."""
    with_refs = sum(1 for r in records if r.references)
    convention = family.call_convention()
    most = convention.input_images
    needed = convention.min_input_images
    if needed and (without := [r for r in records if len(r.references) < needed]):
        raise UserError(
            f"train: {len(without)} of {len(records)} instance images list no reference images, and {family.title} "
            "edits input images only (it makes no image from a prompt alone); ingest an edit dataset (ingest's "
            "control_dir or cond_image_column: metadata.jsonl `reference_file_names`) or train a text-to-image base.")
    if with_refs and family.inputs.trains and (over := [r for r in records if len(r.references) > most]):
        counts = sorted({len(r.references) for r in over})
        raise UserError(
            f"train: {len(over)} of {len(records)} instance images list {'/'.join(map(str, counts))} reference images; "
            f"{family.title} takes at most {most} per target (its pipeline's input images); ingest a dataset "
            f"with at most {most} (metadata.jsonl `reference_file_names`).")
    if with_refs and not family.inputs.trains:
        raise UserError(
            f"train: {with_refs} of {len(records)} instance images list reference images (metadata.jsonl "
            f"`reference_file_names`, from ingest's control_dir or cond_image_column), but {family.title} does "
            "not train on reference images; use a base that does (FLUX.2 [klein], e.g. builtin:tiny-flux2), "
            "or ingest the dataset without control_dir / cond_image_column.")
