"""The scoring both evaluate and train use: CLIP-T's text, and CLIP-T / CLIP-I / DINO of image sets."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from tasks.common.scoring import Encoders, Scorer, clip_t_scores, clip_t_text, cosine_matrix

pytestmark = pytest.mark.quick  # make test-fast


def test_clip_t_text_leaves_out_the_identifier_only() -> None:
    assert clip_t_text("a photo of sks toy on the beach", "sks") == "a photo of toy on the beach"
    assert clip_t_text("a sksy toy, sks.", "sks") == "a sksy toy, ."
    assert clip_t_text("  a  toy ", None) == "a toy"


def test_cosines_and_clip_t_on_known_vectors() -> None:
    a = np.array([[1.0, 0.0], [0.0, 2.0]])
    assert cosine_matrix(a, a) == pytest.approx(np.eye(2))
    assert clip_t_scores(np.array([[1.0, 0.0], [0.0, 1.0]]), a, [1, 1]) == pytest.approx([0.0, 1.0])
    with pytest.raises(ValueError, match="one prompt index per image"):
        clip_t_scores(a, a, [0])


def test_scorer_ranks_a_real_image_above_black_with_the_builtin_encoders() -> None:
    rng = np.random.default_rng(0)
    real = [Image.fromarray(rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)).resize((32, 32)) for _ in range(2)]
    encoders = Encoders.load("builtin:tiny-clip", "builtin:tiny-dino")
    scorer = Scorer(encoders.clip, encoders.dino, encoders.clip.embed_texts(["a toy", "a red toy"]), real)
    black = Image.new("RGB", (32, 32))
    overall, per_prompt = scorer.scores([[real[0]], [black, black]])
    assert set(overall) == {"clip_t", "clip_i", "dino"} and len(per_prompt) == 2
    assert per_prompt[0]["dino"] > per_prompt[1]["dino"] and per_prompt[0]["clip_i"] > per_prompt[1]["clip_i"]
    assert overall["dino"] == pytest.approx((per_prompt[0]["dino"] + 2 * per_prompt[1]["dino"]) / 3)
