"""Class images with the text encoders released before the denoiser loads (tasks/class_images/encoded.py):
for every family, bit for bit the images of the whole pipeline, the encoders' weights freed."""
from __future__ import annotations

import gc
import inspect
import weakref
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tasks.class_images.config import ClassImagesConfig
from tasks.class_images.core import load_pipeline, run, text_calls
from tasks.class_images.encoded import Replay
from tasks.common.families import BUILTINS, build_tiny_pipeline, class_images_refusal

#: three images in batches of two (two batch sizes to encode), guided, with a negative prompt
CFG = dict(prompt="a photo of a toy", negative_prompt="blurry", resolution=64, num_images=3, batch_size=2,
           num_inference_steps=2, guidance_scale=4.0, seed=5)


#: the built-ins that make an image from a prompt alone (an edit-only model makes no class images)
TEXT_TO_IMAGE = sorted(kind for kind, family in BUILTINS.items() if not class_images_refusal(family))


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bases")
    return {kind: build_tiny_pipeline(kind, 0, root / kind.removeprefix("builtin:tiny-")) for kind in TEXT_TO_IMAGE}


def _pixels(folder: Path) -> list[np.ndarray]:
    return [np.asarray(Image.open(p).convert("RGB")) for p in sorted(folder.glob("*.png"))]


@pytest.mark.parametrize("kind", TEXT_TO_IMAGE)
def test_released_text_encoders_make_the_whole_pipelines_images(tmp_path: Path, bases, kind: str) -> None:
    call = BUILTINS[kind].pipeline.diffusers_class().__call__
    takes_negative = "negative_prompt" in inspect.signature(call).parameters
    cfg = ClassImagesConfig(**{**CFG, "negative_prompt": CFG["negative_prompt"] if takes_negative else None})
    base = bases[kind]
    run(cfg, base, tmp_path / "whole", pipe=load_pipeline(base, "cpu"))
    run(cfg, base, tmp_path / "phased")  # no pipe: the stage's own load, text first
    whole, phased = _pixels(tmp_path / "whole"), _pixels(tmp_path / "phased")
    assert len(whole) == len(phased) == 3
    for a, b in zip(whole, phased):
        assert np.array_equal(a, b), f"{kind}: the replayed text changed the image"


def test_the_encoders_weights_are_freed_before_the_denoiser_loads(bases) -> None:
    from tasks.common.families import by_name

    base = bases["builtin:tiny-flux"]
    family = by_name("flux")
    seen: list[weakref.ref] = []
    role = type(family.denoiser)
    original = role.load

    def load_denoiser(self, *args, **kwargs):  # what is alive when the denoiser starts loading
        gc.collect()
        seen.extend(ref for ref in refs if ref() is not None)
        return original(self, *args, **kwargs)

    refs: list[weakref.ref] = []
    from diffusers import DiffusionPipeline

    from_pretrained = DiffusionPipeline.from_pretrained.__func__

    def keep_refs(cls, *args, **kwargs):
        pipe = from_pretrained(cls, *args, **kwargs)
        refs.extend(weakref.ref(getattr(pipe, n)) for n in family.text.encoder_names)
        return pipe

    cfg = ClassImagesConfig(**CFG)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(DiffusionPipeline, "from_pretrained", classmethod(keep_refs))
        mp.setattr(role, "load", load_denoiser)
        pipe = load_pipeline(base, "cpu", encode=text_calls(cfg, [0, 1, 2]))
    assert len(refs) == 2 and not seen, "CLIP and T5 are freed before the transformer loads"
    assert all(isinstance(getattr(pipe, n), Replay) for n in family.text.encoder_names)
    with pytest.raises(RuntimeError, match="released after encoding the class prompt"):
        family.generate(pipe, ["another prompt"], height=64, width=64, steps=1, guidance=4.0)


def test_an_edit_only_base_is_refused_before_it_loads(tmp_path: Path) -> None:
    """Qwen-Image-Edit makes no image from a prompt alone: class images are refused, naming the key to
    turn off, before the model loads or the folder is touched."""
    from tasks.common.errors import UserError

    assert sorted(kind for kind in BUILTINS if kind not in TEXT_TO_IMAGE) == ["builtin:tiny-ltx",
                                                                              "builtin:tiny-qwenimage-edit"]
    base = build_tiny_pipeline("builtin:tiny-qwenimage-edit", 0, tmp_path / "base")
    with pytest.raises(UserError, match=r"Qwen-Image-Edit makes no image from a prompt alone.*"
                                        r"train.with_prior_preservation: false"):
        run(ClassImagesConfig(**CFG), base, tmp_path / "out")
    assert not (tmp_path / "out").exists()
