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


def test_a_clip_is_scored_frame_by_frame_with_its_temporal_consistency(tmp_path) -> None:
    """A video model's filmstrip of 3 frames: each metric is the mean of its frames' scores (so a still
    clip scores as its frame), temporal consistency is 1 for a still clip and lower when frames change;
    the instance clips' subject images are FRAMES_PER_CLIP frames of each clip."""
    import json

    from tasks.common.images import filmstrip
    from tasks.common.scoring import FRAMES_PER_CLIP, TEMPORAL, load_instance_images, split_frames

    rng = np.random.default_rng(1)
    frames = [Image.fromarray(rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)).resize((32, 32)) for _ in range(3)]
    encoders = Encoders.load("builtin:tiny-clip", "builtin:tiny-dino")
    texts = encoders.clip.embed_texts(["a toy"])
    still, moving = filmstrip([frames[0]] * 3), filmstrip(frames)
    assert [f.tobytes() for f in split_frames(moving, 3)] == [f.tobytes() for f in frames]
    clips = Scorer(encoders.clip, encoders.dino, texts, frames[:2], frames=3)
    images = Scorer(encoders.clip, encoders.dino, texts, frames[:2])
    overall = clips.scores([[still]])[0]
    assert overall[TEMPORAL] == pytest.approx(1.0)
    assert {k: overall[k] for k in ("clip_t", "clip_i", "dino")} == pytest.approx(images.scores([[frames[0]]])[0])
    per_frame = images.scores([frames])[0]  # the three frames as images: the clip's scores are their means
    moved = clips.scores([[moving]])[0]
    assert {k: moved[k] for k in ("clip_t", "clip_i", "dino")} == pytest.approx(per_frame)
    assert moved[TEMPORAL] < 0.999 and TEMPORAL not in per_frame

    clip = tmp_path / "clips" / "wave"
    clip.mkdir(parents=True)
    names = [f"{i:04d}.png" for i in range(9)]
    for i, name in enumerate(names):
        Image.new("RGB", (8, 8), (i * 20, 0, 0)).save(clip / name)
    (tmp_path / "clips.jsonl").write_text(json.dumps({"file_name": "clips/wave", "frame_files": names}) + "\n")
    subject = load_instance_images(tmp_path)
    assert [im.getpixel((0, 0))[0] for im in subject] == [0, 60, 100, 160][:FRAMES_PER_CLIP]
