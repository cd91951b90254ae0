"""The edit set: an edit dataset's (references, target, instruction) triples through the tiny FLUX.2
[klein] fine-tune and base, each edit scored against its target and instruction (issue 43)."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tasks.common.errors import UserError
from tasks.common.families.flux2 import Flux2Klein
from tasks.evaluate import edits as E
from tasks.evaluate.config import EvaluateConfig
from tests.export.tiny_ov import tiny_pipeline

pytestmark = pytest.mark.quick  # make test-fast

SIDE = 64  # Flux2KleinPipeline takes reference images of 64 px a side and more


def write_edit_set(folder: Path, counts: tuple[int, ...] = (1, 2, 1)) -> Path:
    """Targets t<i>.png with `counts[i]` references each, as ingest writes them (references/...)."""
    (folder / "references").mkdir(parents=True)
    rng = np.random.default_rng(7)
    rows = []
    for i, count in enumerate(counts):
        Image.fromarray(rng.integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)).save(folder / f"t{i}.png")
        names = [f"references/t{i}.png"] if count == 1 else [f"references/t{i}_{j}.png" for j in range(count)]
        for name in names:
            Image.fromarray(rng.integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)).save(folder / name)
        rows.append({"file_name": f"t{i}.png", "text": f"make the sks toy number {i} red",
                     "reference_file_names": names})
    (folder / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def _config(**kw) -> EvaluateConfig:
    base = dict(prompts=["a {identifier} {class_name}"], images_per_prompt=1, num_inference_steps=2,
                drift={"enabled": False}, edits={"max_pairs": 2})
    return EvaluateConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def flux2(tmp_path_factory) -> Path:
    return tiny_pipeline(tmp_path_factory, "builtin:tiny-flux2")


@pytest.fixture(scope="module")
def edit_data(tmp_path_factory) -> Path:
    return write_edit_set(tmp_path_factory.mktemp("edits") / "processed")


@pytest.fixture(scope="module")
def run(flux2, edit_data):
    """evaluate() with the base fed in as the fine-tune (gains exactly 0) on 3 triples, max_pairs 2;
    every pipeline call recorded. The prompts' images are made at 64 px, not the tiny model's
    native 256 (time: the edit set is what is tested here)."""
    import tasks.evaluate.core as core
    import tasks.evaluate.phases as phases
    from tasks.common.openvino_model import StaticShape

    calls: list[dict] = []
    generate = Flux2Klein.generate.__func__

    def spy(cls, pipe, prompts, **kw):
        calls.append({"prompts": prompts, **kw})
        return generate(cls, pipe, prompts, **kw)

    mp = pytest.MonkeyPatch()
    mp.setattr(Flux2Klein, "generate", classmethod(spy))
    mp.setattr(phases, "default_shape", lambda pipe: StaticShape(1, SIDE, SIDE, 1))
    try:
        result = core.evaluate(flux2, flux2, edit_data, _config(gate={"min_edit_dino": -1.0}))
    finally:
        mp.undo()
    return {"result": result, "calls": calls}


def test_edit_metrics_and_the_base_comparison(run):
    result = run["result"]
    metrics = result.report["metrics"]
    for name in ("clip_t", "clip_i", "dino"):
        assert -1.0 <= metrics[f"edit_{name}"] <= 1.0
        assert metrics[f"base_edit_{name}"] == metrics[f"edit_{name}"]  # the fine-tune is the base
        assert metrics[f"gain_edit_{name}"] == 0.0
    assert result.report["edits"]["pairs"] == 2 and result.report["generation"]["edit_pairs"] == 2
    rows = result.edit_rows
    assert [r["target"] for r in rows] == ["t0.png", "t1.png"]  # max_pairs 2 of 3 triples
    assert rows[1]["references"] == "references/t1_0.png references/t1_1.png"
    assert rows[0]["clip_t_text"] == "make the toy number 0 red"  # the identifier left out, as for prompts
    assert np.mean([r["dino"] for r in rows]) == pytest.approx(metrics["edit_dino"], abs=1e-5)
    assert result.report["gate"]["checks"]["edit_dino"]["passed"] is True


def test_one_call_per_triple_with_its_references_at_its_targets_size_from_the_same_latents(run, edit_data):
    edit_calls = [c for c in run["calls"] if c.get("image") is not None]
    assert len(edit_calls) == 4  # 2 triples x (fine-tune, base)
    tuned, base = edit_calls[:2], edit_calls[2:]
    for i, (a, b) in enumerate(zip(tuned, base)):
        assert a["prompts"] == b["prompts"] == [f"make the sks toy number {i} red"]
        assert (a["height"], a["width"]) == (SIDE, SIDE)
        assert a["latents"].shape[0] == 1 and a["latents"].equal(b["latents"])
        assert len(a["image"]) == (1, 2)[i]
        with Image.open(edit_data / f"references/t{i}{'' if i == 0 else '_1'}.png") as ref:
            assert np.array_equal(np.asarray(a["image"][-1]), np.asarray(ref.convert("RGB")))
    assert tuned[0]["latents"].equal(tuned[1]["latents"])  # one fixed seed: evaluate.seed
    assert all(c.get("image") is None for c in run["calls"][:1])  # the prompts stay text-to-image


def test_the_protocol_carries_the_edit_set(run, edit_data, tmp_path):
    from tasks.evaluate import protocol as P

    settings = run["result"].report["protocol"]["settings"]
    triples = E.load_triples(edit_data, 2)
    assert settings["edits"] == {"set": E.set_hash(triples), "pairs": 2}
    other = write_edit_set(tmp_path / "other", counts=(1, 1))
    assert E.set_hash(E.load_triples(other, 2)) != settings["edits"]["set"]
    assert E.set_hash(E.load_triples(edit_data, 3)) != settings["edits"]["set"]  # max_pairs changes the set
    common = dict(prompts=["p"], clip_texts=["p"], backend="pytorch", precision={"all": "f32"}, shape={},
                  instance="x", heldout=None, base_backend=None)
    cfg = _config()
    without = P.describe(cfg, **common)
    assert "edits" not in without["settings"]  # evaluations without an edit set keep their ids
    assert P.describe(cfg, **common, edits=settings["edits"])["id"] != without["id"]


def test_plots_have_the_edit_grid_and_table(run, tmp_path):
    from tasks.evaluate.__main__ import write_plots

    paths = write_plots(run["result"], tmp_path, 1)
    with Image.open(paths["grid_edits"]) as grid:  # 2 references, target, fine-tune, base per row
        assert grid.size == (5 * SIDE, 2 * SIDE)
    with open(paths["edits_csv"], newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert list(rows[0]) == ["target", "instruction", "clip_t_text", "references", "clip_t", "clip_t_base",
                             "clip_i", "clip_i_base", "dino", "dino_base"]


def test_the_references_reach_the_pipeline(flux2, edit_data):
    """The same triple with its reference mirrored: another edit; with the same reference: the same."""
    import torch
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(flux2, dtype=torch.float32)
    (triple,) = E.load_triples(edit_data, 1)
    mirrored = E.Triple(triple.name, triple.instruction, triple.target, triple.reference_names,
                        tuple(r.transpose(Image.Transpose.FLIP_LEFT_RIGHT) for r in triple.references))
    settings = dict(seed=0, num_inference_steps=2, guidance_scale=1.0, desc="test")
    images, _ = E.generate(pipe, [triple, mirrored, triple], **settings)
    a, b, c = (np.asarray(im[0], dtype=np.int16) for im in images)
    assert a.shape == (SIDE, SIDE, 3)
    assert np.array_equal(a, c)
    assert np.abs(a - b).max() > 0, "the reference image changes the edit"


def test_a_family_without_references_is_refused(tmp_path_factory, edit_data):
    from tasks.evaluate.core import evaluate

    sd = tiny_pipeline(tmp_path_factory, "builtin:tiny-sd")
    with pytest.raises(UserError, match=r"edit dataset \(2 targets list reference images.*Stable Diffusion.* "
                                        r"does not take reference images.*evaluate.edits.enabled: false"):
        evaluate(sd, None, edit_data, _config())
    with pytest.raises(UserError, match="does not take reference images"):  # before the export's images
        evaluate(sd, None, edit_data, _config(), export=tmp_path_factory.mktemp("no-export"))


def test_edit_thresholds_need_an_edit_set(tmp_path):
    from tasks.evaluate.core import _edit_set
    from tests.export.tiny_ov import write_subject_images

    plain = write_subject_images(tmp_path / "plain", n=2)
    with pytest.raises(UserError, match="evaluate.gate.min_edit_clip_i scores the edit set.*set "
                                        "evaluate.gate.min_edit_clip_i: null"):
        _edit_set(plain, _config(gate={"min_edit_clip_i": 0.5}))
    assert _edit_set(plain, _config()) == []
    with pytest.raises(ValueError, match="gate.min_edit_dino needs edits.enabled: true"):
        _config(edits={"enabled": False}, gate={"min_edit_dino": 0.5})
    with pytest.raises(ValueError, match="gate.min_gain_edit_dino needs compare_base: true"):
        _config(compare_base=False, gate={"min_gain_edit_dino": 0.0})


def test_max_pairs_and_enabled_bound_the_set(edit_data, tmp_path):
    from tasks.evaluate.core import _edit_set

    assert [t.name for t in E.load_triples(edit_data, 1)] == ["t0.png"]
    assert len(E.load_triples(edit_data, 10)) == 3
    assert _edit_set(edit_data, _config(edits={"enabled": False})) == []
    broken = write_edit_set(tmp_path / "broken")
    (broken / "references" / "t1_1.png").unlink()
    with pytest.raises(UserError, match=r"lists references/t1_1.png, which are missing.*dvc repro ingest"):
        E.load_triples(broken, 3)
