"""Masked training: the loss sees only the subject (for a DDPM family and a packed flow-matching one),
the mask follows its image through crop, flip and the latent caches, and a short run trains with it."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from tasks.common.errors import UserError
from tasks.train.config import TrainConfig
from tasks.train.diffusion import latent_mask
from tests.train.conftest import write_imagefolder

SEQ = 32


@pytest.fixture(scope="session")
def masked_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two 32 px images whose masks keep the left half (255) and drop the right (0); one without a mask."""
    folder = write_imagefolder(tmp_path_factory.mktemp("masked") / "processed", 3, "a photo of sks toy", 7,
                               size=(32, 32))
    (folder / "masks").mkdir()
    mask = np.zeros((32, 32), np.uint8)
    mask[:, :16] = 255
    rows = [json.loads(line) for line in (folder / "metadata.jsonl").read_text().splitlines()]
    for row in rows[:2]:
        row["mask_file_name"] = f"masks/{Path(row['file_name']).stem}.png"
        row["mask_source"] = "file"
        Image.fromarray(mask, "L").save(folder / row["mask_file_name"])
    (folder / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def _config(tmp_path: Path, **kw) -> TrainConfig:
    base = dict(max_train_steps=2, train_batch_size=1, resolution=32, num_validation_images=0,
                with_prior_preservation=False, checkpoints_dir=tmp_path / "ckpt", checkpointing_steps=1000,
                masked_loss=True)
    return TrainConfig(**{**base, **kw})


def _gradients(method, components, batch, outside: torch.Tensor | None) -> list[torch.Tensor]:
    """Gradients of the denoiser after one loss, with the target moved by +5 where `outside` is 1."""
    noise = method.objective.noise

    def moved(latents, rand):
        noised = noise(latents, rand)
        if outside is not None:
            noised.target = noised.target + 5.0 * outside
        return noised

    method.objective.noise = moved
    denoiser = components.modules[components.family.denoiser.name]
    denoiser.zero_grad(set_to_none=True)
    loss, _ = method.compute_loss(batch, components.modules)
    loss.backward()
    method.objective.noise = noise
    return [p.grad.clone() for p in denoiser.parameters() if p.grad is not None]


@pytest.mark.parametrize("base_name", ["tiny_sd", "tiny_flux"])
def test_the_error_outside_the_mask_does_not_train(request, tmp_path, masked_dir, base_name) -> None:
    """Whatever the denoiser gets wrong outside the subject changes no gradient with masked_loss, and
    does without it: the mask lies on the prediction where the image is, FLUX's packing included.

    (The denoiser sees the whole image, as in kohya's and OneTrainer's masked training: pixels
    outside the subject still shape the prediction inside it through the receptive field; what the
    mask removes is every pull towards the background's own content.)"""
    from tasks.train.methods import METHODS
    from tasks.train.models import load_components

    base = request.getfixturevalue(base_name)
    seq = dict(max_sequence_length=SEQ) if base_name == "tiny_flux" else {}
    method = METHODS["dreambooth"](_config(tmp_path, **seq))
    dataset = method.dataset(masked_dir, None)
    components = load_components(base)
    method.bind(components)
    method.configure()
    batch = method.collate([dataset[(0, 0)]])
    assert batch.masks[0] is not None and not batch.mask_off[0]
    vae = components.modules["vae"]
    with torch.no_grad():
        shape = components.family.codec.scale_latents(vae, vae.encode(batch.pixels).latent_dist.mean).shape
    mask = latent_mask(dataset.load_mask(dataset.instances[0], (32, 32), (32, 32), (0, 0), False), shape[-2:])
    outside = (mask == 0).float()[None]  # [1, 1, h, w]
    assert 0 < outside.mean() < 1
    grads = {}
    for masked in (True, False):  # the same batch, model and noise; only the option differs
        method.cfg = method.cfg.model_copy(update={"masked_loss": masked})
        grads[masked] = [_gradients(method, components, batch, None), _gradients(method, components, batch, outside)]
    same, moved = grads[True]
    assert all(torch.equal(a, b) for a, b in zip(same, moved)), "the error outside the mask trained"
    same, moved = grads[False]
    assert not all(torch.allclose(a, b) for a, b in zip(same, moved)), "without the mask it must train"


def test_mask_follows_flip_and_weights_the_loss(tmp_path, masked_dir) -> None:
    """A flipped example's mask is flipped with it; the unmasked weight, normalisation and class rows."""
    from tasks.train.masks import loss_weights
    from tasks.train.methods import METHODS

    method = METHODS["dreambooth"](_config(tmp_path, random_flip=True, masked_loss_unmasked_weight=0.25,
                                           normalize_masked_area_loss=True))
    dataset = method.dataset(masked_dir, None)
    flips = {}
    for epoch in range(8):
        example = dataset[(epoch, 0)]["instance"]
        pixels = example["pixels"]
        row = Image.open(dataset.instances[0].path).convert("RGB")
        flipped = not torch.allclose(pixels[:, :, 0], torch.from_numpy(np.asarray(row, np.float32)[:, 0] / 127.5 - 1).T)
        flips[flipped] = example["mask"]
    assert set(flips) == {True, False}
    assert flips[False][0, :, :16].min() == 1 and flips[False][0, :, 16:].max() == 0
    assert torch.equal(flips[True], flips[False].flip(-1))
    weights = loss_weights(method.cfg, [flips[False], None], [False, True], torch.zeros(2, 4, 8, 8))
    assert weights.weights[0, 0, :, :4].min() == 1 and weights.weights[0, 0, :, 4:].max() == 0.25
    assert torch.equal(weights.weights[1], torch.ones(1, 8, 8))  # a class row or an unmasked draw
    err = torch.ones(2, 4, 8, 8)
    assert torch.allclose(weights.mean(err), torch.ones(2))  # normalised by the masked area


def test_masked_loss_without_masks_is_refused(tmp_path, one_image) -> None:
    from tasks.train.methods import METHODS

    with pytest.raises(UserError, match="no instance image has a mask.*masked_loss: false"):
        METHODS["dreambooth"](_config(tmp_path)).dataset(one_image, None)


def test_a_short_masked_run_caches_the_latent_size_mask(tmp_path, tiny_sd, masked_dir, class_dir) -> None:
    """Two steps on tiny-sd with masks, prior preservation and unmasked draws, the latents cached on
    disk: every entry of a masked image holds its latent-size mask; the weights trained."""
    from tasks.train.core import train

    config = _config(tmp_path, max_train_steps=2, train_batch_size=2, with_prior_preservation=True,
                     unmasked_probability=0.5, cache_latents_to_disk=True, disk_cache_dir=tmp_path / "enc")
    outcome = train(config, tiny_sd, masked_dir, class_dir, tmp_path / "out")
    assert all(np.isfinite(h.loss) for h in outcome.history) and len(outcome.history) == 2
    entries = [load_file(p) for p in (tmp_path / "enc").glob("*/??/*.safetensors")]
    masked = [e for e in entries if "mask" in e]
    assert masked and all(e["mask"].shape[-2:] == e["parameters"].shape[-2:] for e in masked)
    assert all(e["mask"].shape[0] == 1 and e["mask"][0, :, -1].max() == 0 for e in masked)
    report = outcome.report()  # dreambooth reads no LoRA keys: the report names none
    assert not {"lora_type", "rank", "lora_alpha"} & set(report)
    assert report["masked_loss"] is True and report["unmasked_probability"] == 0.5


def test_the_report_says_what_trained(tmp_path, tiny_sd, masked_dir) -> None:
    """reports/train.json of DoRA on an int8 base over 3 images, 2 with masks: the adapter type, rank and
    alpha, the base's precision, the optimizer and the masks, flat and named as params.yaml names them."""
    from tasks.train.core import train

    config = _config(tmp_path, method="lora", lora_type="dora", rank=2, base_model_precision="int8",
                     masked_loss_unmasked_weight=0.1, normalize_masked_area_loss=True, fuse_lora=False)
    report = train(config, tiny_sd, masked_dir, None, tmp_path / "out").report()
    assert {k: report[k] for k in ("method", "lora_type", "rank", "lora_alpha", "base_model_precision",
                                   "text_encoder_precision", "optimizer", "train_text_encoder")} == {
        "method": "lora", "lora_type": "dora", "rank": 2, "lora_alpha": 2.0, "base_model_precision": "int8-torchao",
        "text_encoder_precision": "none", "optimizer": "adamw", "train_text_encoder": False}
    assert {k: report[k] for k in ("instance_images", "masked_loss", "masked_images", "masked_loss_unmasked_weight",
                                   "unmasked_probability", "normalize_masked_area_loss")} == {
        "instance_images": 3, "masked_loss": True, "masked_images": 2, "masked_loss_unmasked_weight": 0.1,
        "unmasked_probability": 0.0, "normalize_masked_area_loss": True}


def test_unmasked_draws_are_per_example_and_leave_the_other_draws_alone(tmp_path, masked_dir) -> None:
    """unmasked_probability draws from the example's own (seed, epoch, index) generator: the same in any
    order (so resume stays exact), varying across epochs, and the flip and noise draws do not move."""
    from tasks.train.methods import METHODS

    def dataset(**kw):
        return METHODS["dreambooth"](_config(tmp_path, random_flip=True, **kw)).dataset(masked_dir, None)

    drawn, plain = dataset(unmasked_probability=0.5), dataset()
    items = [(epoch, index) for epoch in range(6) for index in range(3)]
    forward = {item: drawn[item]["instance"] for item in items}
    backward = {item: drawn[item]["instance"] for item in reversed(items)}
    assert all(forward[i]["mask_off"] == backward[i]["mask_off"] for i in items)
    offs = [forward[(epoch, 0)]["mask_off"] for epoch in range(6)]
    assert True in offs and False in offs
    for item in items:
        unmoved = plain[item]["instance"]
        assert not unmoved["mask_off"] and unmoved["noise_seed"] == forward[item]["noise_seed"]
        assert torch.equal(unmoved["pixels"], forward[item]["pixels"])  # the same flip and crop
