"""Loaders: imagefolders with the ingest's tags, caption rules, and examples that depend only on
(seed, epoch, index), which is what makes resume exact and ranks agree without talking."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from tasks.common.errors import UserError
from tasks.train.config import TrainConfig
from tasks.train.data import CaptionPolicy, EpochSampler, Record, TrainDataset, collate, read_imagefolder
from tasks.train.methods import METHODS
from tests.train.conftest import write_imagefolder

pytestmark = pytest.mark.quick  # make test-fast

TAGS = ["sks toy", "red", "plush", "studio", "white background"]


def test_imagefolder_reads_tags_score_and_a_caption_column(tmp_path) -> None:
    folder = write_imagefolder(tmp_path / "data", 2, "a toy", 0, extra=[
        {"tags": TAGS, "tag_separator": " ", "score": 55, "blip": "a red plush toy"},
        {"blip": "a blue plush toy"},
    ])
    rows = read_imagefolder(folder, "instance images", "fix it")
    assert rows[0].tags == tuple(TAGS) and rows[0].tag_separator == " " and rows[0].score == 55
    assert rows[1].tags == () and rows[1].tag_separator == ", " and rows[1].score is None, "tags are optional"
    assert [r.text for r in read_imagefolder(folder, "x", "fix", caption_column="blip")] == [
        "a red plush toy", "a blue plush toy"]
    with pytest.raises(UserError, match=r"metadata.jsonl:1 has no column 'caption'.*train.caption_column"):
        read_imagefolder(folder, "instance images", "fix it", caption_column="caption")


def test_missing_inputs_say_which_stage_to_run(tmp_path, class_dir) -> None:
    method = METHODS["dreambooth"](TrainConfig())
    with pytest.raises(UserError, match="dvc repro ingest"):
        method.dataset(tmp_path / "processed", class_dir)
    (tmp_path / "processed").mkdir()
    (tmp_path / "processed" / "metadata.jsonl").write_text('{"file_name": "gone.png", "text": "x"}\n')
    with pytest.raises(UserError, match="gone.png, which is missing"):
        method.dataset(tmp_path / "processed", class_dir)
    data = write_imagefolder(tmp_path / "data", 1, "x", 0)
    with pytest.raises(UserError, match="prior preservation is on .* class_images"):
        method.dataset(data, tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metadata.jsonl").write_text("")
    with pytest.raises(UserError, match="with_prior_preservation: false"):
        method.dataset(data, tmp_path / "empty")


def test_tag_shuffle_keeps_the_first_n_and_dropout_empties() -> None:
    record = Record(path=None, text=", ".join(TAGS), tags=tuple(TAGS))  # type: ignore[arg-type]
    shuffle = CaptionPolicy(shuffle_tag_p=1.0, keep_tokens=1)
    captions = {shuffle(record, np.random.default_rng(i)) for i in range(30)}
    assert len(captions) > 5, "tags are shuffled"
    assert all(c.startswith("sks toy, ") and sorted(c.split(", ")) == sorted(TAGS) for c in captions)
    assert CaptionPolicy()(record, np.random.default_rng(0)) == record.text, "no rule, the stored caption"
    dropout = CaptionPolicy(proportion_empty_prompts=0.5)
    dropped = [dropout(record, np.random.default_rng(i)) == "" for i in range(400)]
    assert 0.4 < sum(dropped) / len(dropped) < 0.6
    untagged = Record(path=None, text="a plain caption")  # type: ignore[arg-type]
    assert shuffle(untagged, np.random.default_rng(0)) == "a plain caption"


def test_examples_depend_only_on_seed_epoch_and_index(instance_dir, class_dir) -> None:
    instances = read_imagefolder(instance_dir, "i", "f")
    classes = read_imagefolder(class_dir, "c", "f")
    ds = TrainDataset(instances, classes, lambda r, rng: f"p{rng.integers(1000)}", "a toy", 32,
                      center_crop=False, random_flip=True, seed=3)
    assert len(ds) == 4, "every class image once per epoch"
    a, b = ds[(1, 2)], ds[(1, 2)]
    assert torch.equal(a["instance"]["pixels"], b["instance"]["pixels"])
    assert a["instance_prompt"] == b["instance_prompt"]
    variants = {(ds[(e, 2)]["instance"]["crop_top_left"], ds[(e, 2)]["instance_prompt"]) for e in range(8)}
    assert len(variants) > 1, "crops, flips and prompts change between epochs"
    assert a["instance"]["latent_key"] is None, "random crops are never cached"
    fixed = TrainDataset(instances, None, lambda r, rng: "p", "a toy", 32, random_flip=True, seed=3)
    keys = {fixed[(e, 0)]["instance"]["latent_key"] for e in range(8)}
    digest = hashlib.sha256(instances[0].path.read_bytes()).hexdigest()
    assert keys == {f"{digest}:32x32:0", f"{digest}:32x32:1"}, "a centre crop is cached per content, size and flip"
    batch = collate([ds[(0, 0)], ds[(0, 1)]])
    assert batch.pixels.shape == (4, 3, 32, 32) and batch.num_instances == 2
    assert batch.prompts[2:] == ["a toy", "a toy"] and batch.geometry.original_sizes.shape == (4, 2)


def test_epoch_order_is_a_seeded_permutation() -> None:
    sampler = EpochSampler(5, seed=1)
    first = list(sampler)
    assert sorted(i for _, i in first) == list(range(5)) and {e for e, _ in first} == {0}
    assert list(sampler) == first
    sampler.set_epoch(1)
    second = list(sampler)
    assert {e for e, _ in second} == {1} and [i for _, i in second] != [i for _, i in first]


def test_method_prompts(tmp_path) -> None:
    folder = write_imagefolder(tmp_path / "data", 1, "a red plush toy", 0, extra=[{"tags": TAGS}])
    record = read_imagefolder(folder, "x", "f")[0]
    rng = np.random.default_rng(0)
    assert METHODS["dreambooth"](TrainConfig()).prompt(record, rng) == "a photo of sks toy"
    assert METHODS["full"](TrainConfig(method="full")).prompt(record, rng) == "a red plush toy", "full: the captions"
    ti = METHODS["textual_inversion"](TrainConfig(
        method="textual_inversion", placeholder_token="<t>", initializer_token="toy", num_vectors=3,
        with_prior_preservation=False))
    prompts = {ti.prompt(record, np.random.default_rng(i)) for i in range(20)}
    assert len(prompts) > 3 and all("<t> <t>_1 <t>_2" in p for p in prompts)
    style = METHODS["textual_inversion"](TrainConfig(
        method="textual_inversion", placeholder_token="<t>", initializer_token="toy", learnable_property="style",
        with_prior_preservation=False))
    assert "in the style of <t>" in style.prompt(record, rng)
    assert ti.validation_prompts() == ["a photo of a <t>"], "the pipeline expands <t> to its vectors itself"
