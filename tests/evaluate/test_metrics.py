"""Metric functions on hand-made embeddings with known answers, the gate, prompt/batch planning."""
from __future__ import annotations

import math

import numpy as np
import pytest

from tasks.common.config import parse_section
from tasks.common.errors import UserError
from tasks.evaluate import metrics as M
from tasks.evaluate.config import EvaluateConfig
from tasks.evaluate.core import render_prompts
from tasks.evaluate.generate import batches, plan

pytestmark = pytest.mark.quick  # make test-fast

E = np.eye(3)  # three orthogonal unit vectors


def test_cosine_identical_is_one_and_orthogonal_is_zero():
    sims = M.cosine_matrix(E, E)
    np.testing.assert_allclose(sims, np.eye(3), atol=1e-12)
    # Not normalised on the way in: still cosines.
    diagonal = M.cosine_matrix(np.array([[3.0, 0, 0]]), np.array([[2.0, 2.0, 0]]))[0, 0]
    assert diagonal == pytest.approx(1 / math.sqrt(2))
    assert M.cosine_matrix(np.array([[1.0, 0]]), np.array([[-5.0, 0]]))[0, 0] == pytest.approx(-1.0)


def test_mean_pairwise_cosine_known_values():
    assert M.mean_pairwise_cosine(E[:1], E[:1]) == pytest.approx(1.0)  # identical images
    assert M.mean_pairwise_cosine(E[:1], E[1:]) == pytest.approx(0.0)  # orthogonal features
    # generated {e0}, real {e0, e1}: pairs 1 and 0 -> 0.5
    assert M.mean_pairwise_cosine(E[:1], E[:2]) == pytest.approx(0.5)
    assert math.isnan(M.mean_pairwise_cosine(np.zeros((0, 3)), E))
    with pytest.raises(ValueError, match="sizes differ"):
        M.mean_pairwise_cosine(E, np.eye(4))


def test_mean_self_cosine_excludes_self_pairs():
    assert M.mean_self_cosine(E) == pytest.approx(0.0)
    assert M.mean_self_cosine(np.stack([E[0], E[0]])) == pytest.approx(1.0)
    assert math.isnan(M.mean_self_cosine(E[:1]))


def test_clip_t_pairs_each_image_with_its_prompt():
    text = E[:2]
    images = np.stack([E[0], E[1], E[0]])
    scores = M.clip_t_scores(text, images, [0, 1, 1])
    np.testing.assert_allclose(scores, [1.0, 1.0, 0.0], atol=1e-12)


def test_gate_passes_and_fails_by_threshold():
    metrics = {"clip_t": 0.2, "clip_i": 0.8, "dino": 0.6, "gain_dino": 0.1}
    thresholds = {"min_clip_i": 0.7, "min_dino": 0.5, "min_gain_dino": 0.0, "min_clip_t": None}
    ok = M.gate(metrics, thresholds)
    assert ok["passed"] and set(ok["checks"]) == {"clip_i", "dino", "gain_dino"}
    bad = M.gate(metrics, {"min_clip_i": 0.7, "min_dino": 0.65})
    assert not bad["passed"]
    assert bad["checks"]["dino"] == {"value": 0.6, "min": 0.65, "passed": False}
    assert bad["checks"]["clip_i"]["passed"]
    assert M.gate(metrics, {"min_dino": None})["passed"]  # nothing asked


def test_gate_fails_on_nan_or_missing():
    verdict = M.gate({"clip_i": float("nan")}, {"min_clip_i": -1.0, "min_gain_dino": -1.0})
    assert not verdict["passed"]
    assert verdict["checks"]["clip_i"]["value"] is None
    assert not verdict["checks"]["gain_dino"]["passed"]


def test_prompts_are_templated_and_clip_t_text_drops_identifier():
    cfg = EvaluateConfig(
        prompts=["a {identifier} {class_name} in the jungle", "a red {identifier} {class_name}"]
    )
    prompts, texts = render_prompts(cfg)
    assert prompts == ["a sks toy in the jungle", "a red sks toy"]
    assert texts == ["a toy in the jungle", "a red toy"]


def test_config_errors_name_the_key():
    with pytest.raises(UserError, match=r"evaluate.prompts.*\['subject'\]"):
        parse_section("evaluate", {"prompts": ["a {subject}"]}, EvaluateConfig)
    with pytest.raises(UserError, match="compare_base"):
        section = {"prompts": ["x"], "compare_base": False, "gate": {"min_gain_dino": 0}}
        parse_section("evaluate", section, EvaluateConfig)
    with pytest.raises(UserError, match="evaluate.gate.min_clip_i"):
        parse_section("evaluate", {"prompts": ["x"], "gate": {"min_clip_i": 2}}, EvaluateConfig)
    with pytest.raises(UserError, match="unknown key"):
        parse_section("evaluate", {"prompts": ["x"], "gate": {"min_clipi": 0.5}}, EvaluateConfig)


def test_plan_and_batches_cover_every_image_once():
    units = plan(["p0", "p1", "p2"], images_per_prompt=3, seed=10, per_prompt_call=2)
    # per prompt: seeds (10, 11) keep 2, then (12, 13) keep 1 (13 is generated and dropped)
    first_two = [(u.prompt_index, u.seeds, u.keep) for u in units[:2]]
    assert first_two == [(0, (10, 11), 2), (0, (12, 13), 1)]
    assert sum(u.keep for u in units) == 9
    groups = batches(units, batch_size=4)
    assert [real for _, real in groups] == [4, 2]
    assert all(len(chunk) == 4 for chunk, _ in groups)  # the last one padded to the static batch
    assert groups[-1][0][-1] == units[-1]
