"""The built-in evaluation encoders: seeded, normalised, loaded like real ones; hub ids offline."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from tasks.common.errors import UserError
from tasks.common.tiny_encoders import (
    TINY_HIDDEN,
    TINY_PROJECTION,
    build_tiny_clip,
    load_clip,
    load_dino,
)

pytestmark = pytest.mark.quick  # make test-fast


def _images(n: int = 3) -> list[Image.Image]:
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (48, 40, 3), dtype=np.uint8)) for _ in range(n)]


@pytest.fixture(scope="module")
def clip():
    return load_clip("builtin:tiny-clip", seed=0)


@pytest.fixture(scope="module")
def dino():
    return load_dino("builtin:tiny-dino", seed=0)


def test_clip_embeddings_are_unit_vectors_of_the_projection_size(clip):
    images = clip.embed_images(_images())
    texts = clip.embed_texts(["a sks toy in the jungle", "a red toy"])
    assert images.shape == (3, TINY_PROJECTION) and texts.shape == (2, TINY_PROJECTION)
    assert clip.embedding_dim == TINY_PROJECTION
    np.testing.assert_allclose(np.linalg.norm(images, axis=1), 1.0, atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(texts, axis=1), 1.0, atol=1e-6)
    assert not np.allclose(texts[0], texts[1])


def test_dino_embeddings_are_unit_cls_tokens(dino):
    emb = dino.embed_images(_images(2) + [Image.new("L", (50, 50))])  # any mode/size is accepted
    assert emb.shape == (3, TINY_HIDDEN) and dino.embedding_dim == TINY_HIDDEN
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-6)
    with pytest.raises(TypeError):
        dino.embed_texts(["a toy"])


def test_builtins_are_deterministic_from_the_seed(clip, dino):
    images = _images()
    again_clip = load_clip("builtin:tiny-clip", seed=0).embed_images(images)
    again_dino = load_dino("builtin:tiny-dino", seed=0).embed_images(images)
    np.testing.assert_array_equal(again_clip, clip.embed_images(images))
    np.testing.assert_array_equal(again_dino, dino.embed_images(images))
    other = load_dino("builtin:tiny-dino", seed=1).embed_images(images)
    assert not np.allclose(other, dino.embed_images(images))


def test_batching_does_not_change_embeddings(clip):
    images = _images(5)
    full = clip.embed_images(images)
    clip.batch_size = 2
    try:
        np.testing.assert_allclose(clip.embed_images(images), full, atol=1e-5)
    finally:
        clip.batch_size = 32


def test_local_folder_loads_like_a_hub_model(tmp_path, clip):
    folder = build_tiny_clip(0, tmp_path / "my-clip")
    local = load_clip(str(folder))
    np.testing.assert_array_equal(local.embed_images(_images()), clip.embed_images(_images()))


def test_offline_hub_id_is_a_user_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    with pytest.raises(UserError) as err:
        load_clip("openai/clip-vit-base-patch32", key="evaluate.clip_model")
    message = str(err.value)
    assert "offline" in message and "builtin:tiny-clip" in message
    assert "--local-dir DIR" in message and "evaluate.clip_model: DIR" in message
    with pytest.raises(UserError, match="builtin:tiny-dino"):
        load_dino("facebook/dino-vits16", key="evaluate.dino_model")


def test_bad_names_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="unknown built-in encoder"):
        load_clip("builtin:tiny-clap")
    with pytest.raises(UserError, match="no config.json"):
        load_dino(str(tmp_path))
    with pytest.raises(UserError, match="neither"):
        load_dino("not a model id")
