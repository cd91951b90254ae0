"""Qwen-Image-Edit (2511): the text encoder sees the input images and their latents join the
transformer's sequence; training computes both as QwenImageEditPlusPipeline does."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from tasks.common import families
from tasks.common.families import PredictInputs
from tests.train.test_references import _config


@pytest.fixture(scope="module")
def edit_pipe(tiny_qwenimage_edit):
    from diffusers import QwenImageEditPlusPipeline

    return QwenImageEditPlusPipeline.from_pretrained(tiny_qwenimage_edit)


def _pixels(image: Image.Image) -> torch.Tensor:
    """An image as training holds a reference: (1, 3, H, W) in [-1, 1]."""
    return torch.from_numpy(np.asarray(image, dtype=np.float32) / 127.5 - 1.0).permute(2, 0, 1)[None]


def test_the_family_encodes_and_predicts_what_the_pipeline_computes(tiny_qwenimage_edit, edit_pipe) -> None:
    """One step of QwenImageEditPlusPipeline with two input images: the transformer's call seen by a
    hook. The family's text conditioning from the prompt and the images as training holds them equals
    the pipeline's prompt embeddings; the family's reference pixels encode to the image tokens the
    pipeline appended; its prediction from the same latents equals the transformer's output."""
    from diffusers import QwenImageEditPlusPipeline as Pipe

    family = families.detect(tiny_qwenimage_edit)
    assert family.name == "qwenimage-edit" and family.inputs.trains and family.text.sees_references
    rng = np.random.default_rng(4)
    images = [Image.fromarray(rng.integers(0, 256, (32, 48, 3), dtype=np.uint8)),
              Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8))]
    seen = []
    hook = edit_pipe.transformer.register_forward_hook(lambda m, a, kw, out: seen.append((kw, out[0])),
                                                       with_kwargs=True)
    with torch.no_grad():
        out = family.generate(edit_pipe, ["make it red"], steps=2, height=64, width=64, image=images, guidance=1.0,
                              generator=torch.Generator().manual_seed(0), output_type="pil")
    hook.remove()
    assert out[0].size == (64, 64)
    kwargs, output = seen[0]
    components = family.load_components(tiny_qwenimage_edit)
    refs = [_pixels(im) for im in images]
    with torch.no_grad():
        hidden, mask = family.text.encode_batch_text(components, ["make it red"], [], None, refs)
    assert mask.bool().all() and kwargs["encoder_hidden_states_mask"] is None  # one prompt: nothing masked
    assert torch.allclose(hidden, kwargs["encoder_hidden_states"], atol=1e-5)
    # the references: a megapixel each at their ratio (1248x832 and 1024x1024), 8x smaller, 2x2 tokens
    shapes = kwargs["img_shapes"][0]
    assert shapes == [(1, 4, 4), (1, 52, 78), (1, 64, 64)]
    target = 4 * 4
    vae = components.vae
    with torch.no_grad():
        latents = []
        for ref, (_, h, w) in zip(refs, shapes[1:]):
            pixels = family.inputs.pixels(ref)
            assert pixels.shape[-2:] == (h * 16, w * 16)
            moments = vae.encode(family.codec.vae_input(pixels)).latent_dist.mode()
            latents.append(family.codec.scale_latents(vae, moments))
    tokens = kwargs["hidden_states"]
    first = Pipe._pack_latents(latents[0], 1, 4, 104, 156)
    assert torch.allclose(first, tokens[:, target : target + first.shape[1]], atol=1e-4)
    noisy = Pipe._unpack_latents(tokens[:, :target], 64, 64, 8)[:, :, 0]
    inputs = PredictInputs(resolution=64, guidance_scale=1.0, references=latents)
    with torch.no_grad():
        pred = family.denoiser.predict(edit_pipe.transformer, noisy, kwargs["timestep"] * 1000, hidden, mask, inputs)
    assert torch.allclose(pred, Pipe._unpack_latents(output[:, :target], 64, 64, 8)[:, :, 0], atol=1e-4)


def test_qwenimage_edit_trains_on_an_edit_dataset(tmp_path, tiny_qwenimage_edit, edit_dir) -> None:
    """Two LoRA steps on targets with one and two references; the text cache stays off (the text
    encoder sees the references), said in the log."""
    from tasks.train.core import train

    outcome = train(_config(tmp_path, method="lora"), tiny_qwenimage_edit, edit_dir, None, tmp_path / "out")
    losses = [h.loss for h in outcome.history]
    assert outcome.family == "qwenimage-edit" and len(losses) == 2 and all(np.isfinite(losses)), losses
    assert (tmp_path / "out" / "pytorch_lora_weights.safetensors").is_file()


def test_a_hub_layout_base_loads_without_torchvision(tmp_path, tiny_qwenimage_edit) -> None:
    """The hub's model_index.json names transformers' Qwen2VLProcessor (its video part needs torchvision,
    which is not installed): the base stage's resolve of such a folder names the image-only processor,
    and the pipeline and the training components load from it."""
    import json
    import shutil

    from diffusers import DiffusionPipeline

    from tasks.base.core import resolve

    hub = tmp_path / "hub-layout"
    shutil.copytree(tiny_qwenimage_edit, hub)
    index = json.loads((hub / "model_index.json").read_text())
    (hub / "model_index.json").write_text(json.dumps({**index, "processor": ["transformers", "Qwen2VLProcessor"]}))
    with pytest.raises((ImportError, OSError), match="torchvision|video processor"):  # transformers' own class
        DiffusionPipeline.from_pretrained(hub)
    dst = tmp_path / "base"
    dst.mkdir()
    info = resolve(str(hub), None, 0, dst)
    assert info["family"] == "qwenimage-edit"
    assert json.loads((dst / "model_index.json").read_text())["processor"][0] == "finetune_runtime.vl_processor"
    assert type(DiffusionPipeline.from_pretrained(dst).processor).__name__ == "ImageQwen2VLProcessor"
    components = families.detect(dst).load_components(dst)
    assert components.tokenizers[0].image_processor is not None
