"""Edit training on (reference images, target, instruction) triples: which families take them, and
FLUX.2 [klein] training with the reference latents in its input sequence."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tasks.common.errors import UserError
from tasks.train.batch import ReferenceImages
from tasks.train.config import TrainConfig

SEQ = 32


def _config(tmp_path: Path, **kw) -> TrainConfig:
    base = dict(max_train_steps=2, train_batch_size=1, resolution=32, num_validation_images=0,
                with_prior_preservation=False, checkpoints_dir=tmp_path / "ckpt", checkpointing_steps=1000)
    return TrainConfig(**{**base, **kw})


def test_a_family_without_references_refuses_an_edit_dataset(tmp_path, tiny_sd, edit_dir) -> None:
    from tasks.train.core import train

    with pytest.raises(UserError, match=r"2 of 2 instance images list reference images .*reference_file_names.*"
                                        r"Stable Diffusion.* does not train on reference images"):
        train(_config(tmp_path), tiny_sd, edit_dir, None, tmp_path / "out")


def test_a_missing_reference_file_is_named(tmp_path, edit_dir) -> None:
    from tasks.train.data import read_imagefolder

    broken = tmp_path / "broken"
    broken.mkdir()
    for p in edit_dir.rglob("*.*"):
        (broken / p.relative_to(edit_dir)).parent.mkdir(parents=True, exist_ok=True)
        (broken / p.relative_to(edit_dir)).write_bytes(p.read_bytes())
    next((broken / "references").glob("*_1.png")).unlink()
    with pytest.raises(UserError, match=r"lists the reference image\(s\) references/img1_1.png, which are missing"):
        read_imagefolder(broken, "instance images", "Rerun ingest.")


def test_a_reference_follows_its_target_through_crop_flip_and_bucket() -> None:
    """A reference identical to its target comes out identical to it, whatever crop and flip the target got."""
    from tasks.train.data import prepare_image
    from tasks.train.references import prepare_reference

    rng = np.random.default_rng(3)
    image = Image.fromarray(rng.integers(0, 256, (48, 80, 3), dtype=np.uint8))
    for flip in (False, True):
        pixels, original, crop = prepare_image(image, (32, 48), False, flip, np.random.default_rng(5))
        assert crop != (0, 0) or flip  # a random corner, not the centre
        assert torch.equal(prepare_reference(image, original, (32, 48), crop, flip), pixels)


def _batch(tmp_path, base, edit_dir, **kw):
    from tasks.train.methods import METHODS
    from tasks.train.models import load_components

    method = METHODS["lora"](_config(tmp_path, max_sequence_length=SEQ, **kw))
    dataset = method.dataset(edit_dir, None)
    components = load_components(base)
    method.bind(components)
    method.configure()
    method.setup_caches()  # the in-memory latent cache (cache_latents with centre crops)
    return method, components, dataset


def test_flux2_sees_the_reference_tokens_and_they_change_the_prediction(tmp_path, tiny_flux2, edit_dir) -> None:
    """The transformer's input sequence is the target's tokens, then each reference's, with time
    coordinates 10, 20 as Flux2KleinPipeline gives image inputs; other references, another prediction."""
    method, components, dataset = _batch(tmp_path, tiny_flux2, edit_dir)
    batch = method.collate([dataset[(0, 1)]])  # the target with two references
    assert len(batch.references.pixels) == 2 and batch.references.pixels[0].shape == (1, 3, 32, 32)
    denoiser = components.modules["transformer"]
    seen = []
    hook = denoiser.register_forward_hook(lambda m, args, kwargs, out: seen.append(kwargs), with_kwargs=True)
    with torch.no_grad():
        loss, _ = method.compute_loss(batch, components.modules)
        swapped = method.collate([dataset[(0, 1)]])
        # not the cached latents of the unflipped references: no keys
        swapped.references = ReferenceImages([r.flip(-1) for r in swapped.references.pixels], [[None], [None]])
        other, _ = method.compute_loss(swapped, components.modules)
    hook.remove()
    assert torch.isfinite(loss) and loss != other, "the references change the prediction"
    ids, hidden = seen[0]["img_ids"], seen[0]["hidden_states"]
    tokens = 8 * 8  # 32 px / the tiny VAE's factor 2 / 2x2 patches: 8 x 8 tokens per image
    assert hidden.shape[1] == ids.shape[1] == 3 * tokens
    assert ids[0, :tokens, 0].unique().tolist() == [0]
    assert ids[0, tokens:2 * tokens, 0].unique().tolist() == [10] and ids[0, 2 * tokens:, 0].unique().tolist() == [20]
    assert method.latent_cache is not None and sum(k.startswith("ref:") for k in method.latent_cache.store) == 2


def test_flux2_trains_on_an_edit_dataset(tmp_path, tiny_flux2, edit_dir) -> None:
    """Two steps of LoRA on (references, target, instruction): finite losses, weights written; the
    references' latents kept in the disk latent cache beside the targets'."""
    from tasks.train.core import train

    config = _config(tmp_path, method="lora", max_sequence_length=SEQ, cache_latents_to_disk=True,
                     disk_cache_dir=tmp_path / "enc")
    outcome = train(config, tiny_flux2, edit_dir, None, tmp_path / "out")
    losses = [h.loss for h in outcome.history]
    assert len(losses) == 2 and all(np.isfinite(losses)), losses
    assert outcome.weights, "the adapter was written"
    from safetensors import safe_open

    keys = []
    for path in (tmp_path / "enc").rglob("*.safetensors"):
        with safe_open(str(path), "pt") as fh:
            keys.append((fh.metadata() or {}).get("key", ""))
    assert sum(k.startswith("ref:") for k in keys) == 3, keys  # each reference once (no flips)


def test_prior_preservation_beside_an_edit_dataset_is_refused(tmp_path, tiny_flux2, edit_dir, class_dir) -> None:
    from tasks.train.core import train

    with pytest.raises(UserError, match="train.with_prior_preservation: class images have no reference images"):
        train(_config(tmp_path, max_sequence_length=SEQ, with_prior_preservation=True), tiny_flux2, edit_dir,
              class_dir, tmp_path / "out")


def test_batches_of_an_edit_dataset_hold_one_reference_count(edit_dir) -> None:
    """Targets with one and with two references never share a batch (one token sequence length), also
    in buckets; a dataset of one count and no buckets draws its batches from all examples."""
    from tasks.train.buckets import BucketBatchSampler
    from tasks.train.data import TrainDataset, read_imagefolder

    records = read_imagefolder(edit_dir, "instance images", "") * 3  # 6 targets: 3 with one reference, 3 with two
    dataset = TrainDataset(records, None, lambda r, rng: r.text, "", 32)
    groups = dataset.batch_groups()
    assert groups == [(0, 1), (0, 2)] * 3
    for epoch in range(4):
        batches = BucketBatchSampler(groups, 2, seed=epoch).batches(epoch)
        assert sorted(i for b in batches for i in b) == list(range(6))
        assert all(len({len(records[i].references) for i in b}) == 1 for b in batches), batches
        assert sorted(map(len, batches)) == [1, 1, 2, 2]
    same = [r for r in records if len(r.references) == 1]
    assert TrainDataset(same, None, lambda r, rng: r.text, "", 32).batch_groups() is None
    bucketed = TrainDataset(records, None, lambda r, rng: r.text, "", 32, buckets=[(32, 32), (32, 48)])
    assert bucketed.batch_groups() == [(0, 1), (0, 2)] * 3


def test_the_caching_pass_holds_the_references_a_step_needs(tmp_path, tiny_flux2, edit_dir) -> None:
    """After the caching pass before the first step, a step encodes nothing: targets and references are in."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    method, components, dataset = _batch(tmp_path, tiny_flux2, edit_dir)
    accelerator = SimpleNamespace(process_index=0, num_processes=1, is_local_main_process=True,
                                  autocast=nullcontext, wait_for_everyone=lambda: None)
    method.fill_latent_cache(dataset, accelerator)
    cache = method.latent_cache
    assert sum(k.startswith("ref:") for k in cache.store) == 3 and cache.misses == 2 + 3
    with torch.no_grad():
        for index in range(len(dataset)):
            method.compute_loss(method.collate([dataset[(0, index)]]), components.modules)
    assert cache.misses == 5, "every latent a step needed was cached before it"


def test_the_edit_demo_from_ingest_trains_on_flux2(tmp_path, tiny_flux2, caplog) -> None:
    """data/demo/edits.py -> ingest (control_dir) -> two LoRA steps on tiny FLUX.2 [klein] at batch 2
    (the demo mixes one and two references: batches of one count), with flips, on each target's
    instruction (train.caption_column null): the stages' contract holds end to end."""
    import subprocess
    import sys

    from tasks.train.core import train
    from tests.conftest import REPO
    from tests.ingest.util import config, run

    subprocess.run([sys.executable, str(REPO / "data/demo/edits.py"), "--out", str(tmp_path / "edits")], check=True)
    ingested = run(config([{"type": "folder", "path": str(tmp_path / "edits"), "control_dir": "control"}],
                          resolution=32, near_duplicate_distance=None), tmp_path / "processed")
    assert len(ingested.kept) == 4 and not ingested.rejected
    from tasks.train.methods.assembly import DataAssembly

    seen: list[str] = []
    collate = DataAssembly.collate

    def recording(self, examples):
        batch = collate(self, examples)
        seen.extend(batch.prompts)
        return batch

    caplog.set_level("INFO", logger="tasks.train")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DataAssembly, "collate", recording)
        outcome = train(_config(tmp_path, method="lora", max_sequence_length=SEQ, random_flip=True,
                                train_batch_size=2), tiny_flux2, tmp_path / "processed", None, tmp_path / "out")
    assert len(outcome.history) == 2 and all(np.isfinite(h.loss) for h in outcome.history)
    instructions = {(tmp_path / "edits" / f"edit_0{i}.txt").read_text().strip() for i in range(4)}
    assert seen and set(seen) <= instructions, (seen, instructions)
    assert "prompts: each target's instruction, column 'text'" in caplog.text
    assert outcome.trained["edit_pairs"] == 4 and outcome.trained["instance_images"] == 4  # reports/train.json's
    assert outcome.trained["caption_column"] == "text"
