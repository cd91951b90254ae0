"""Every train output reaches the registry: LoRA adapters saved without `fuse_lora` are registered
with their base and load through the pyfunc; the method table says what each method leaves."""
from __future__ import annotations

import base64
import io
import shutil
from pathlib import Path

import mlflow
import numpy as np
import pytest
from PIL import Image

from tasks.common.errors import UserError
from tasks.register.core import register
from tasks.register.model_contents import LORA_WEIGHTS, model_artifacts

PROMPT = "a photo of sks toy"


def _lora_adapters(base: Path, out: Path) -> None:
    """Adapters in the train stage's format (diffusers LoRA file), with non-zero weights."""
    import torch
    from diffusers import StableDiffusionPipeline
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    pipe = StableDiffusionPipeline.from_pretrained(base)
    torch.manual_seed(0)
    pipe.unet.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights=False,
                                     target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    layers = convert_state_dict_to_diffusers(get_peft_model_state_dict(pipe.unet))
    StableDiffusionPipeline.save_lora_weights(out, unet_lora_layers=layers,
                                              weight_name=LORA_WEIGHTS, safe_serialization=True)


def _image(pipe) -> np.ndarray:
    import torch

    pipe.set_progress_bar_config(disable=True)
    out = pipe(PROMPT, num_inference_steps=2, guidance_scale=7.5, height=64, width=64,
               generator=torch.Generator("cpu").manual_seed(7), output_type="np")
    return (out.images[0] * 255).round().astype(np.uint8)


@pytest.fixture
def adapters_project(project: Path) -> Path:
    """The project with models/finetuned holding LoRA adapters only, and models/base."""
    shutil.move(project / "models/finetuned", project / "models/base")
    (project / "models/finetuned").mkdir()
    _lora_adapters(project / "models/base", project / "models/finetuned")
    return project


def test_unfused_lora_registers_with_its_base_and_predicts_through_the_pyfunc(
        adapters_project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from diffusers import DiffusionPipeline

    root = adapters_project
    result = register(root / "models/finetuned", root / "models/openvino",
                      root / "reports/evaluate.json", root / "dvc.lock", root / "params.yaml",
                      base=root / "models/base")
    version = mlflow.MlflowClient().get_model_version(result.name, result.version)
    assert version.tags["model.artifacts"] == "lora_adapters+base"

    monkeypatch.setenv("FINETUNE_PYFUNC_BACKEND", "diffusers")
    model = mlflow.pyfunc.load_model(result.model_uri)
    out = model.predict([PROMPT], params={"num_inference_steps": 2, "seed": 7})
    got = np.asarray(Image.open(io.BytesIO(base64.b64decode(out["image"][0]))).convert("RGB"))

    expected = DiffusionPipeline.from_pretrained(root / "models/base")
    plain = _image(expected)
    expected.load_lora_weights(root / "models/finetuned", weight_name=LORA_WEIGHTS)
    assert np.array_equal(got, _image(expected))  # the adapters were applied to the base ...
    assert not np.array_equal(got, plain)  # ... and they change the image


def test_unfused_lora_without_base_is_refused_with_the_fix(adapters_project: Path) -> None:
    root = adapters_project
    with pytest.raises(UserError, match=r"LoRA adapters only .* pass --base models/base"):
        register(root / "models/finetuned", root / "models/openvino",
                 root / "reports/evaluate.json", root / "dvc.lock", root / "params.yaml")
    assert mlflow.MlflowClient().search_registered_models() == []


# What each train method leaves in models/finetuned (tasks/train/methods/*.py `save`), the same
# for SD 1.x/2.x and SDXL; every export mode (compression none/int8/int4/hybrid/full_int8,
# single_file) changes only models/openvino, which always holds an OpenVINO pipeline folder.
METHOD_OUTPUTS = {
    "dreambooth": ["model_index.json"],
    "full": ["model_index.json"],
    "textual_inversion": ["model_index.json", "learned_embeds.safetensors"],
    "lora, fuse_lora: true": ["model_index.json", LORA_WEIGHTS],
    "lora, fuse_lora: false": [LORA_WEIGHTS],
}
EXPECTED_ARTIFACTS = {
    "dreambooth": {"finetuned", "openvino"},
    "full": {"finetuned", "openvino"},
    "textual_inversion": {"finetuned", "openvino"},
    "lora, fuse_lora: true": {"finetuned", "openvino"},
    "lora, fuse_lora: false": {"finetuned", "openvino", "base"},
}


@pytest.mark.parametrize("method", sorted(METHOD_OUTPUTS))
def test_every_method_output_has_registrable_artifacts(tmp_path: Path, method: str) -> None:
    finetuned, openvino, base = tmp_path / "finetuned", tmp_path / "openvino", tmp_path / "base"
    for folder, files in ((finetuned, METHOD_OUTPUTS[method]), (openvino, ["model_index.json"]),
                          (base, ["model_index.json"])):
        folder.mkdir()
        for name in files:
            (folder / name).write_text("{}")
    assert set(model_artifacts(finetuned, openvino, base)) == EXPECTED_ARTIFACTS[method]
    if "base" not in EXPECTED_ARTIFACTS[method]:
        assert set(model_artifacts(finetuned, openvino, None)) == EXPECTED_ARTIFACTS[method]


def test_the_method_table_covers_every_method() -> None:
    """A new train method must be added to the table (and, if it saves another layout, to
    tasks/register/model_contents.py model_artifacts)."""
    from tasks.train.method_specs import names

    methods = set(names())
    assert {m.split(",")[0] for m in METHOD_OUTPUTS} == methods


def test_unfused_lokr_registers_and_predicts_through_peft(project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """LoKr (train.lora_type: lokr), which diffusers' LoRA loader cannot read, saved in peft's layout
    without fuse_lora: registered with its base, the pyfunc fuses it through peft."""
    import torch
    from diffusers import DiffusionPipeline

    from finetune_runtime.adapters import apply_peft
    from tasks.common.adapters import peft_config, save_peft_adapters

    root = project
    shutil.move(root / "models/finetuned", root / "models/base")
    base = DiffusionPipeline.from_pretrained(root / "models/base")
    torch.manual_seed(0)
    base.unet.add_adapter(peft_config("lokr", 4, 4, 0.0, ["to_q", "to_k", "to_v", "to_out.0"]))
    for name, param in base.unet.named_parameters():
        if "lokr_w1" in name:  # LoKr starts as a no-op (w1 zero): give it weights to see
            torch.nn.init.normal_(param, std=0.5)
    save_peft_adapters(root / "models/finetuned/peft_adapters", {"unet": base.unet})
    result = register(root / "models/finetuned", root / "models/openvino", root / "reports/evaluate.json",
                      root / "dvc.lock", root / "params.yaml", base=root / "models/base")
    assert mlflow.MlflowClient().get_model_version(result.name, result.version).tags["model.artifacts"] == \
        "lora_adapters+base"

    monkeypatch.setenv("FINETUNE_PYFUNC_BACKEND", "diffusers")
    out = mlflow.pyfunc.load_model(result.model_uri).predict([PROMPT], params={"num_inference_steps": 2, "seed": 7})
    got = np.asarray(Image.open(io.BytesIO(base64.b64decode(out["image"][0]))).convert("RGB"))
    expected = DiffusionPipeline.from_pretrained(root / "models/base")
    plain = _image(expected)
    apply_peft(expected, root / "models/finetuned/peft_adapters")
    assert np.array_equal(got, _image(expected))
    assert not np.array_equal(got, plain)


def test_a_base_over_base_copy_max_gb_is_registered_by_reference_and_found_again(
        adapters_project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """register.base_copy_max_gb: a base over it is not copied into the version: the version names it
    (path, DVC hash, file sizes), the pyfunc loads it from there or from FINETUNE_BASE_DIR, and a
    folder that is not the registered base, or no base at all, is refused naming the fix."""
    from finetune_runtime import base_reference

    root = adapters_project
    params = root / "params.yaml"
    params.write_text(params.read_text() + "  base_copy_max_gb: 0\n")
    lock = root / "dvc.lock"
    lock.write_text(lock.read_text() + "  base:\n    cmd: python -m tasks.base\n    params:\n      params.yaml:\n"
                    "        base:\n          model: builtin:tiny-sd\n    outs:\n    - path: models/base\n"
                    "      hash: md5\n      md5: 44444444444444444444444444444444.dir\n")
    result = register(root / "models/finetuned", root / "models/openvino", root / "reports/evaluate.json",
                      lock, params, base=root / "models/base")
    client = mlflow.MlflowClient()
    version = client.get_model_version(result.name, result.version)
    assert version.tags["model.artifacts"] == "lora_adapters+base_reference"
    local = Path(mlflow.artifacts.download_artifacts(result.model_uri))
    assert sorted(p.name for p in (local / "artifacts").iterdir()) == ["base_reference", "finetuned", "openvino"]
    lineage = mlflow.artifacts.load_dict(f"runs:/{version.run_id}/lineage.json")["base_reference"]
    assert lineage["path"] == str((root / "models/base").resolve())
    assert lineage["dvc_md5"] == "44444444444444444444444444444444.dir"
    assert lineage["model"] == "builtin:tiny-sd" and lineage["size_bytes"] > 0

    monkeypatch.setenv("FINETUNE_PYFUNC_BACKEND", "diffusers")

    def predicted() -> np.ndarray:
        out = mlflow.pyfunc.load_model(result.model_uri).predict([PROMPT], params={"num_inference_steps": 2,
                                                                                  "seed": 7})
        return np.asarray(Image.open(io.BytesIO(base64.b64decode(out["image"][0]))).convert("RGB"))

    from diffusers import DiffusionPipeline

    expected = DiffusionPipeline.from_pretrained(root / "models/base")
    expected.load_lora_weights(root / "models/finetuned", weight_name=LORA_WEIGHTS)
    assert np.array_equal(predicted(), _image(expected))  # found where it was registered from

    moved = root.parent / "elsewhere"
    shutil.move(root / "models/base", moved)
    with pytest.raises(ValueError, match=r"registered by reference .* set FINETUNE_BASE_DIR"):
        predicted()
    monkeypatch.setenv(base_reference.BASE_DIR_ENV, str(moved))
    assert np.array_equal(predicted(), _image(expected))  # found where the variable says
    (moved / "model_index.json").write_text((moved / "model_index.json").read_text() + " ")
    with pytest.raises(ValueError, match=r"FINETUNE_BASE_DIR=.* is not this version's base: .*model_index.json has"):
        predicted()


def test_a_referenced_base_serves_in_the_precision_the_fine_tune_trained_on(
        adapters_project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Adapters trained on an int8 base, registered with the base by reference (a 12B base would not fit
    in bf16 beside its text encoders): the version's model_config says so, and its diffusers backend
    loads the denoiser quantized as it loads (diffusers' torchao config), as evaluate scored it."""
    import json

    import torch
    from diffusers import DiffusionPipeline

    from finetune_runtime import base_reference
    from tests.register.conftest import TRAIN_REPORT

    root = adapters_project
    params = root / "params.yaml"
    params.write_text(params.read_text() + "  base_copy_max_gb: 0\n")
    report = root / "reports/train.json"
    report.write_text(json.dumps({**TRAIN_REPORT, "method": "lora", "base_model_precision": "int8"}))
    result = register(root / "models/finetuned", root / "models/openvino", root / "reports/evaluate.json",
                      root / "dvc.lock", params, base=root / "models/base", train_report=report)
    monkeypatch.setenv("FINETUNE_PYFUNC_BACKEND", "diffusers")
    model = mlflow.pyfunc.load_model(result.model_uri)
    assert model.model_config["base_precision"] == {"unet": "int8"}  # the text encoder trained in fp32
    kinds = {type(m.weight).__name__ for n, m in model.unwrap_python_model().pipe.unet.named_modules()
             if isinstance(m, torch.nn.Linear) and "lora_" not in n}
    assert kinds == {"Int8Tensor"}, kinds  # every base Linear quantized, not the stored fp32 (the LoRA's are not)
    out = model.predict([PROMPT], params={"num_inference_steps": 2, "seed": 7})
    got = np.asarray(Image.open(io.BytesIO(base64.b64decode(out["image"][0]))).convert("RGB"))
    base = str(root / "models/base")
    expected = DiffusionPipeline.from_pretrained(base, **base_reference.quantization({"unet": "int8"}))
    expected.load_lora_weights(root / "models/finetuned", weight_name=LORA_WEIGHTS)
    assert np.array_equal(got, _image(expected))
