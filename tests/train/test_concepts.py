"""Several concepts in one run: repeats, class images of each concept's own, loss weights, errors."""
from __future__ import annotations

from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tasks.common.errors import UserError
from tasks.train.concepts import examples_report
from tasks.train.config import TrainConfig
from tasks.train.data import collate
from tasks.train.layout import Layout, repeated
from tasks.train.methods import METHODS
from tests.train.conftest import write_imagefolder

QUICK = pytest.mark.quick  # all but the loss test, which builds the tiny SD model

CONCEPTS = [
    {"name": "sks dog", "instance_prompt": "a photo of sks dog", "class_prompt": "a photo of a dog",
     "loss_weight": 2.0},
    {"name": "ohwx cat", "class_prompt": "a photo of a cat", "repeats": 3},  # prompts: the rows' captions
]


@pytest.fixture(scope="module")
def two_concepts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """data/processed with 2 dog rows (repeats 1 from ingest) and 1 cat row; class images per concept."""
    root = tmp_path_factory.mktemp("concepts")
    extra = [{"concept": "sks dog", "repeats": 1}, {"concept": "sks dog", "repeats": 1},
             {"concept": "ohwx cat", "repeats": 5, "text": "ohwx cat on a sofa"}]
    data = write_imagefolder(root / "processed", 3, "sks dog", 0, extra=extra)
    classes = root / "class_images"
    write_imagefolder(classes / "sks dog", 3, "a photo of a dog", 1)
    write_imagefolder(classes / "ohwx cat", 2, "a photo of a cat", 2)
    return data, classes


def method_for(**kw):
    cfg = TrainConfig(**{"resolution": 32, "concepts": CONCEPTS, **kw})
    return METHODS[cfg.method](cfg)


@QUICK
def test_repeats_pair_each_image_with_its_own_concepts_class_images(two_concepts) -> None:
    data, classes = two_concepts
    method = method_for()
    ds = method.dataset(data, classes)
    # dog: 2 images x1, 3 class images -> 3 examples; cat: 1 image x3 (params over ingest's 5), 2 class -> 3
    assert len(ds) == 6
    examples = [ds[(0, i)] for i in range(len(ds))]
    shown = Counter((e["concept"], ds.instances[ds.layout.instance(i)].path.name) for i, e in enumerate(examples))
    assert shown == {("sks dog", "img0.png"): 2, ("sks dog", "img1.png"): 1, ("ohwx cat", "img2.png"): 3}
    for i, e in enumerate(examples):
        _, _, c = ds.layout.locate(i)
        assert ds.classes_[c].path.parent.name == e["concept"], "a class image of its own concept"
        assert e["class_prompt"] == {"sks dog": "a photo of a dog", "ohwx cat": "a photo of a cat"}[e["concept"]]
        assert e["instance_prompt"] == {"sks dog": "a photo of sks dog", "ohwx cat": "ohwx cat on a sofa"}[e["concept"]]
    seen_classes = {ds.classes_[ds.layout.locate(i)[2]].path for i in range(len(ds))}
    assert len(seen_classes) == 5, "every class image once per epoch"
    batch = collate([examples[0], examples[5]])
    assert batch.concepts == ["sks dog", "ohwx cat"]
    assert batch.loss_weights.tolist() == [2.0, 1.0, 2.0, 1.0], "instance rows, then their class rows"
    report = examples_report(ds.layout, ds.instances, Counter({"sks dog": 7}))
    assert report["ohwx cat"] == {"images": 1, "repeats": 3.0, "examples_per_epoch": 3, "class_images": 2,
                                  "loss_weight": 1.0, "examples_seen": 0}
    assert report["sks dog"]["examples_seen"] == 7 and report["sks dog"]["loss_weight"] == 2.0
    assert method.validation_prompts() == ["a photo of sks dog", "ohwx cat on a sofa"]
    prompts = {"a photo of sks dog", "ohwx cat on a sofa", "a photo of a dog", "a photo of a cat"}
    assert prompts <= method.fixed_prompts(), "the text cache holds every concept's prompts"


@QUICK
def test_without_concepts_the_layout_is_the_plain_dataset_and_rows_repeat_as_ingest_said(two_concepts) -> None:
    plain = Layout.single([1, 1, 1], 4)
    assert len(plain) == 4
    assert [plain.locate(i)[1:] for i in range(4)] == [(0, 0), (1, 1), (2, 2), (0, 3)], "index % n, index % k"
    assert repeated([7, 8], [1, 3]) == (7, 8, 8, 8)
    data, classes = two_concepts
    ds = METHODS["dreambooth"](TrainConfig(resolution=32, with_prior_preservation=False)).dataset(data, None)
    assert len(ds) == 7, "2 dog rows x1 + the cat row x5 (ingest's repeats)"
    assert {ds[(0, i)]["instance_prompt"] for i in range(7)} == {"a photo of sks toy"}
    assert collate([ds[(0, 0)]]).loss_weights is None, "no weights: the loss is computed as before"


@QUICK
def test_concept_errors_name_the_problem_and_the_fix(tmp_path: Path, two_concepts) -> None:
    data, classes = two_concepts
    with pytest.raises(UserError, match=r"'sks bird' has no images .*concepts: 'ohwx cat', 'sks dog'"):
        method_for(concepts=[*CONCEPTS, {"name": "sks bird", "class_prompt": "a bird"}]).dataset(data, classes)
    only_dog = METHODS["dreambooth"](TrainConfig(concepts=CONCEPTS[:1]))
    with pytest.raises(UserError, match=r"does not list 'ohwx cat'"):
        only_dog.dataset(data, classes)
    with pytest.raises(UserError, match=r"concept 'sks dog'.*List concept 'sks dog' in class_images.concepts"):
        method_for().dataset(data, tmp_path)
    with pytest.raises(UserError, match=r"no class images folder was given \(--class-data\)"):
        method_for().dataset(data, None)
    with pytest.raises(ValueError, match=r"'ohwx cat' without class_prompt"):
        TrainConfig(concepts=[CONCEPTS[0], {"name": "ohwx cat"}])
    with pytest.raises(ValueError, match="listed twice"):
        TrainConfig(concepts=[CONCEPTS[0], CONCEPTS[0]])
    with pytest.raises(ValueError, match=r"concepts\.0\.name\n.*folder name"):
        TrainConfig(concepts=[{"name": "a/b", "class_prompt": "x"}])


def test_loss_weights_multiply_each_examples_loss(tiny_sd, two_concepts) -> None:
    from tasks.train.models import load_components

    data, classes = two_concepts
    method = method_for(with_prior_preservation=False,
                        concepts=[{**c, "class_prompt": None} for c in CONCEPTS])
    ds = method.dataset(data, None)
    method.bind(load_components(tiny_sd))
    method.configure()
    method.place(torch.device("cpu"), torch.float32)
    method.setup_caches()
    batch = method.collate([ds[(0, 0)], ds[(0, 3)]])  # a dog example (weight 2), a cat one (weight 1)
    assert batch.loss_weights.tolist() == [2.0, 1.0]

    def loss(weights):
        b = replace(batch, loss_weights=torch.tensor(weights))
        with torch.no_grad():
            return method.compute_loss(b, method.components.modules)[0].item()

    dog, cat = loss([1.0, 0.0]), loss([0.0, 1.0])
    assert dog > 0 and cat > 0
    assert loss([2.0, 1.0]) == pytest.approx(2 * dog + cat, rel=1e-5)
    assert loss([1.0, 1.0]) == pytest.approx(dog + cat, rel=1e-5)
    assert method.concepts_seen == {"sks dog": 4, "ohwx cat": 4}


def test_a_run_reports_examples_seen_per_concept(tmp_path: Path, tiny_sd, two_concepts) -> None:
    from tasks.train.core import train

    data, classes = two_concepts
    config = method_for(max_train_steps=3, train_batch_size=2, num_validation_images=0,
                        checkpoints_dir=tmp_path / "ckpt", checkpointing_steps=1000).cfg
    report = train(config, tiny_sd, data, classes, tmp_path / "out").report()
    concepts = report["concepts"]
    assert sum(c["examples_seen"] for c in concepts.values()) == 3 * 2, "every instance example, counted once"
    assert {k: (c["images"], c["examples_per_epoch"], c["class_images"]) for k, c in concepts.items()} == {
        "ohwx cat": (1, 3, 2), "sks dog": (2, 3, 3)}
