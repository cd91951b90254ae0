"""Adding a family is adding one module: the toy family of toy_family.py, registered here, goes
through train (LoRA on its own targets, validation images), export (parity through its pipeline
call) and the served model's predict, with no other file changed."""
from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image
from safetensors.torch import load_file

from tasks.common import families
from tests.common.toy_family import CALLS, ToyFamily


@pytest.fixture
def toy():
    families.register(ToyFamily, first=True)
    CALLS.clear()
    yield ToyFamily
    families.unregister(ToyFamily.name)


def _one_image(folder):
    folder.mkdir(parents=True)
    small = np.random.default_rng(0).integers(0, 256, (4, 4, 3), dtype=np.uint8)
    Image.fromarray(small).resize((32, 32), Image.Resampling.BICUBIC).save(folder / "a.png")
    (folder / "metadata.jsonl").write_text('{"file_name": "a.png", "text": "a photo of sks toy"}\n')
    return folder


def test_a_family_from_one_module_trains_exports_and_serves(toy, tmp_path):
    import torch

    from finetune_runtime.load import Loaded
    from finetune_runtime.model import DiffusionImageModel
    from tasks.common.openvino_model import load_ov_pipeline
    from tasks.export.config import ExportConfig
    from tasks.export.core import export
    from tasks.train.config import TrainConfig
    from tasks.train.core import train

    base = families.build_tiny_pipeline(toy.builtin, 0, tmp_path / "base")
    assert families.detect(base) is toy
    torch.set_num_threads(1)
    cfg = TrainConfig(method="lora", max_train_steps=2, train_batch_size=1, resolution=32, rank=4, fuse_lora=True,
                      num_validation_images=1, validation_inference_steps=2, with_prior_preservation=False,
                      checkpoints_dir=tmp_path / "ckpt", checkpointing_steps=1000)
    out = tmp_path / "finetuned"
    outcome = train(cfg, base, _one_image(tmp_path / "data"), None, out)
    assert outcome.family == toy.name
    layers = {k.split(".lora")[0].rsplit(".", 1)[1] for k in load_file(out / "pytorch_lora_weights.safetensors")}
    assert layers == set(toy.denoiser.lora_targets), layers
    assert ("StableDiffusionPipeline", 2, 32, 32) in CALLS, CALLS  # validation went through the family

    CALLS.clear()
    report = export(out, tmp_path / "openvino", ExportConfig(height=32, width=32, parity={"num_inference_steps": 2}))
    assert report["parity"]["passed"], report["parity"]
    assert [c[0] for c in CALLS[:2]] == ["StableDiffusionPipeline", "OVStableDiffusionPipeline"], CALLS
    assert families.detect(tmp_path / "openvino") is toy

    model = DiffusionImageModel()
    pipe = load_ov_pipeline(tmp_path / "openvino", static=True)
    model.serve(Loaded(pipe, "openvino", str(tmp_path / "openvino")),
                {"pipeline_call": toy.call_convention().as_config()})
    rows = model.predict(None, ["a photo of sks toy"], {"num_inference_steps": 2})
    image = Image.open(io.BytesIO(base64.b64decode(rows["image"][0])))
    assert image.size == (32, 32)
