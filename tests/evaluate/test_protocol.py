"""The paper's prompt sets, held-out metrics, drift/FD functions, the protocol (PSNR: tests/common/test_psnr.py)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tasks.common.config import parse_section
from tasks.common.errors import UserError
from tasks.evaluate import metrics as M
from tasks.evaluate.config import EvaluateConfig
from tasks.evaluate.core import evaluate, render_prompts
from tasks.evaluate.prompts import LIVE_PROMPTS, OBJECT_PROMPTS
from tests.export.tiny_ov import tiny_pipeline, write_subject_images

#: make test-fast runs every test here but the two that run the evaluate stage on a tiny pipeline
#: (generation, the base's images, the scoring encoders: 10 to 15 s each), which make test runs
quick = pytest.mark.quick


@quick
def test_paper_prompt_sets():
    assert len(OBJECT_PROMPTS) == len(set(OBJECT_PROMPTS)) == 25
    assert len(LIVE_PROMPTS) == len(set(LIVE_PROMPTS)) == 25
    assert OBJECT_PROMPTS[:10] == LIVE_PROMPTS[:10] and OBJECT_PROMPTS[-5:] == LIVE_PROMPTS[-5:]
    cfg = EvaluateConfig(prompt_set="live", identifier="sks", class_name="dog")
    prompts, texts = render_prompts(cfg)
    assert prompts[0] == "a sks dog in the jungle" and texts[0] == "a dog in the jungle"
    assert "a sks dog wearing a santa hat" in prompts and len(prompts) == 25
    short = EvaluateConfig(prompt_set="object", max_prompts=3)
    assert render_prompts(short)[0] == ["a sks toy in the jungle", "a sks toy in the snow",
                                        "a sks toy on the beach"]


@quick
def test_config_rules():
    with pytest.raises(UserError, match="prompt_set custom needs prompts"):
        parse_section("evaluate", {}, EvaluateConfig)
    with pytest.raises(UserError, match="evaluate.prompt_set"):
        parse_section("evaluate", {"prompt_set": "animals"}, EvaluateConfig)
    with pytest.raises(UserError, match="needs drift.enabled"):
        parse_section("evaluate", {"prompt_set": "object", "drift": {"enabled": False},
                                   "gate": {"min_drift_dino": 0.5}}, EvaluateConfig)
    with pytest.raises(UserError, match="evaluate.drift.prompts"):
        parse_section("evaluate", {"prompt_set": "object", "drift": {"prompts": ["{kind}"]}},
                      EvaluateConfig)


@quick
def test_frechet_distance_and_paired_cosine_known_values():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(200, 4))
    a -= a.mean(axis=0)  # centred: scaling keeps the mean
    assert M.frechet_distance(a, a) == pytest.approx(0.0, abs=1e-8)
    shift = np.array([3.0, 0.0, 0.0, 4.0])
    assert M.frechet_distance(a, a + shift) == pytest.approx(25.0, abs=1e-6)  # |shift|^2
    # Scaling by 2: same means, Tr(S + 4S - 2*2S) = Tr(S).
    assert M.frechet_distance(a, 2 * a) == pytest.approx(np.trace(np.cov(a, rowvar=False)), rel=1e-6)
    assert M.paired_cosine(a, 3 * a) == pytest.approx(1.0)
    assert M.paired_cosine(np.eye(3), np.roll(np.eye(3), 1, axis=0)) == pytest.approx(0.0)
    with pytest.raises(ValueError):
        M.paired_cosine(a, a[:5])


def test_heldout_metrics(tmp_path_factory, tmp_path):
    model = tiny_pipeline(tmp_path_factory, "builtin:tiny-sd")
    data = write_subject_images(tmp_path / "instance", n=2)
    heldout = write_subject_images(tmp_path / "heldout", n=3)
    rows = [json.loads(x) for x in (heldout / "metadata.jsonl").read_text().splitlines()]
    for i, row in enumerate(rows):
        row["text"] = ["a red disc", "a blue toy", "a toy on a table"][i]
    (heldout / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = EvaluateConfig(prompts=["a {identifier} {class_name}"], images_per_prompt=1,
                         num_inference_steps=2, heldout={"enabled": True})
    with pytest.raises(UserError, match="--heldout-data"):
        evaluate(model, None, data, cfg)
    result = evaluate(model, model, data, cfg, heldout=heldout)
    metrics = result.report["metrics"]
    assert result.report["generation"]["backend"] == "pytorch"
    assert result.report["generation"]["heldout_images"] == 3
    assert -1.0 <= metrics["heldout_clip_t"] <= 1.0 and metrics["heldout_fd"] >= 0.0
    assert -1.0 <= metrics["real_heldout_clip_t"] <= 1.0
    # Base = the same PyTorch model, same seeds: identical images, identical scores.
    assert metrics["base_heldout_fd"] == pytest.approx(metrics["heldout_fd"], abs=1e-6)
    assert metrics["drift_dino"] == pytest.approx(1.0, abs=1e-6)


def _protocol(**changes):
    from tasks.evaluate.protocol import describe

    cfg = EvaluateConfig(**{"prompt_set": "object", "max_prompts": 2, **changes.pop("cfg", {})})
    args = dict(prompts=["a"], clip_texts=["b"], backend="pytorch",
                precision={"all": "f32"}, shape={"height": 64}, instance="i1", heldout=None,
                base_backend="pytorch")
    return describe(cfg, **{**args, **changes})


@quick
def test_the_protocol_id_changes_with_everything_that_changes_a_score():
    same = _protocol()
    assert _protocol()["id"] == same["id"]
    for change in ({"cfg": {"clip_model": "openai/clip-vit-large-patch14", "clip_revision": "r1"}},
                   {"cfg": {"dino_revision": "x", "dino_model": "facebook/dino-vits16"}},
                   {"cfg": {"encoder_seed": 1}}, {"cfg": {"seed": 1}},
                   {"cfg": {"num_inference_steps": 20}}, {"cfg": {"guidance_scale": 5.0}},
                   {"cfg": {"images_per_prompt": 4}}, {"prompts": ["c"]}, {"clip_texts": ["d"]},
                   {"precision": {"all": "bf16"}}, {"backend": "openvino-static"},
                   {"base_backend": None}, {"shape": {"height": 512}},
                   {"instance": "i2"}, {"heldout": "h1"}, {"export_fidelity": None},
                   {"export_fidelity": 3}):
        assert _protocol(**change)["id"] != same["id"], change


@quick
def test_backend_is_gone_with_a_clear_error():
    with pytest.raises(UserError, match="evaluate.backend was removed"):
        parse_section("evaluate", {"prompt_set": "object", "backend": "openvino"}, EvaluateConfig)
    with pytest.raises(UserError, match="needs export_fidelity.enabled"):
        parse_section("evaluate", {"prompt_set": "object", "export_fidelity": {"enabled": False},
                                   "gate": {"min_export_psnr": 30}}, EvaluateConfig)


@quick
def test_only_trained_encoders_are_calibrated():
    assert _protocol()["calibrated"] is False
    assert "builtin:tiny-clip and builtin:tiny-dino" in _protocol()["uncalibrated_reason"]
    real = _protocol(cfg={"clip_model": "/models/clip", "dino_model": "/models/dino"})
    assert real["calibrated"] is True and real["uncalibrated_reason"] is None
    half = _protocol(cfg={"clip_model": "/models/clip"})
    assert half["calibrated"] is False and "builtin:tiny-dino has random" in half["uncalibrated_reason"]


def test_adapters_only_fine_tune_is_applied_to_the_base(tmp_path_factory, tmp_path):
    """A LoRA-only train output (no model_index.json) is evaluated as base + adapters, in PyTorch
    fp32 like the base: the LoRA changes the images, so the class images drift from the base's."""
    from tests.export.adapters import write_adapters

    base = tiny_pipeline(tmp_path_factory, "builtin:tiny-sd")
    adapters = write_adapters(base, tmp_path / "lora", embeds=False)
    data = write_subject_images(tmp_path / "instance", n=2)
    cfg = EvaluateConfig(prompts=["a {identifier} {class_name}"], images_per_prompt=1,
                         num_inference_steps=2)
    with pytest.raises(UserError, match="adapters only"):
        evaluate(adapters, None, data, cfg)
    result = evaluate(adapters, base, data, cfg)
    generation = result.report["generation"]
    assert generation["finetuned"]["method"] == "lora" and generation["backend"] == "pytorch"
    tuned = np.asarray(result.images[0][0], dtype=np.float64)
    plain = np.asarray(result.base_images[0][0], dtype=np.float64)
    assert np.abs(tuned - plain).max() > 0  # the adapters were applied
    assert result.report["metrics"]["drift_dino"] < 1.0
