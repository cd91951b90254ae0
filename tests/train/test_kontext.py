"""FLUX.1 Kontext: the input image's tokens in the transformer's sequence, trained as the pipeline
generates, and the settings it cannot take refused before any load."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tasks.common import families
from tasks.common.errors import UserError
from tasks.common.families import PredictInputs
from tests.train.test_references import _config


@pytest.fixture(scope="module")
def one_reference_dir(edit_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """edit_dir's first target alone, with its one reference (FluxKontextPipeline takes one input image)."""
    folder = tmp_path_factory.mktemp("kontext-edits") / "processed"
    rows = [json.loads(line) for line in (edit_dir / "metadata.jsonl").read_text().splitlines()][:1]
    for name in [rows[0]["file_name"], *rows[0]["reference_file_names"]]:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes((edit_dir / name).read_bytes())
    (folder / "metadata.jsonl").write_text(json.dumps(rows[0]) + "\n")
    return folder


def test_the_family_predicts_what_the_pipeline_computes_with_an_input_image(tiny_kontext) -> None:
    """One step of FluxKontextPipeline with a 48x32 input image at 32x32: the transformer's call seen by
    a hook (the target's tokens, then the image's, ids (1, row, column)) and the family's prediction
    from the same noisy latents and image latents are the same tensor."""
    from diffusers import FluxKontextPipeline

    family = families.detect(tiny_kontext)
    assert family.name == "kontext" and family.inputs.trains
    pipe = FluxKontextPipeline.from_pretrained(tiny_kontext)
    seen = []
    hook = pipe.transformer.register_forward_hook(lambda m, a, kw, out: seen.append((kw, out[0])), with_kwargs=True)
    image = Image.fromarray(np.random.default_rng(4).integers(0, 256, (32, 48, 3), dtype=np.uint8))
    with torch.no_grad():
        out = family.generate(pipe, ["make it red"], steps=1, height=32, width=32, image=[image], guidance=3.5,
                              generator=torch.Generator().manual_seed(0), output_type="pil")
    hook.remove()
    assert out[0].size == (32, 32), "the decided size, not FluxKontextPipeline's max_area"
    kwargs, output = seen[0]
    target, ref = 8 * 8, 8 * 12  # tokens: 32 px / the VAE's 2 / 2x2 packing; the image 48x32 px
    ids = kwargs["img_ids"]
    assert kwargs["hidden_states"].shape[1] == ids.shape[0] == target + ref
    assert ids[:target, 0].unique().tolist() == [0] and ids[target:, 0].unique().tolist() == [1]
    unpack = FluxKontextPipeline._unpack_latents
    noisy = unpack(kwargs["hidden_states"][:, :target], 16, 16, 1)
    reference = unpack(kwargs["hidden_states"][:, target:], 16, 24, 1)
    inputs = PredictInputs(resolution=32, guidance_scale=float(kwargs["guidance"][0]), references=[reference])
    with torch.no_grad():
        pred = family.denoiser.predict(pipe.transformer, noisy, kwargs["timestep"] * 1000,
                                       kwargs["encoder_hidden_states"], kwargs["pooled_projections"], inputs)
    assert torch.allclose(pred, unpack(output[:, :target], 16, 16, 1), atol=1e-5)


def test_kontext_trains_on_a_one_reference_edit_dataset(tmp_path, tiny_kontext, one_reference_dir) -> None:
    from tasks.train.core import train

    outcome = train(_config(tmp_path, method="lora", max_sequence_length=32), tiny_kontext, one_reference_dir, None,
                    tmp_path / "out")
    losses = [h.loss for h in outcome.history]
    assert outcome.family == "kontext" and len(losses) == 2 and all(np.isfinite(losses)), losses
    assert (tmp_path / "out" / "pytorch_lora_weights.safetensors").is_file()


def test_kontext_refuses_a_target_with_two_references(tmp_path, tiny_kontext, edit_dir) -> None:
    from tasks.train.core import train

    with pytest.raises(UserError, match=r"train: 1 of 2 instance images list 2 reference images; FLUX.1 Kontext "
                                        r"takes at most 1"):
        train(_config(tmp_path, method="lora", max_sequence_length=32), tiny_kontext, edit_dir, None, tmp_path / "o")
