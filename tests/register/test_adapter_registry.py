"""Two run-time adapter fine-tunes of one tiny-sd base registered on one base export, and that base
export's endpoint serving both by name and a blend of them over HTTP with `mlflow models serve`
(real MLflow registry, real GenAI)."""
from __future__ import annotations

import base64
import io
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from tasks.common.psnr import psnr_db
from tests.export.adapters import lora_images
from tests.export.tiny_ov import runtime_export, tiny_pipeline
from tests.register.conftest import DVC_LOCK, EVAL_PASS
from tests.register.http_serve import models_serve, post
from tests.runtime.test_adapter_cache import register_adapter

PROMPT = "a photo of sks toy"
CALL = {"num_inference_steps": 2, "seed": 5}


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    base = tiny_pipeline(tmp_path_factory, "builtin:tiny-sd")
    return base, [runtime_export(tmp_path_factory, name, seed, text)
                  for name, seed, text in (("a", 1, False), ("b", 2, True))]


def _register(root: Path, lora: Path, export: Path, base: Path):
    from tasks.register.core import register

    root.mkdir(parents=True, exist_ok=True)
    (root / "params.yaml").write_text("register:\n  model_name: sd-test\n")
    (root / "dvc.lock").write_text(DVC_LOCK)
    (root / "evaluate.json").write_text(json.dumps(EVAL_PASS))
    return register(lora, export, root / "evaluate.json", root / "dvc.lock", root / "params.yaml", base=base)


def config_key(client) -> str:
    """The key of the base export sd-test-base/1 (its tag `base_export.key`, readable by anyone)."""
    return client.get_model_version("sd-test-base", "1").tags["base_export.key"]


def _images(frame) -> list[np.ndarray]:
    return [np.asarray(Image.open(io.BytesIO(base64.b64decode(b))), np.float32) / 255 for b in frame["image"]]


def _pytorch(base: Path, loras: list[Path], weights: list[float]) -> np.ndarray:
    return lora_images(base, loras, weights, CALL["seed"], CALL["num_inference_steps"], prompt=PROMPT)[0]


def test_two_fine_tunes_on_one_base_export_served_by_name_and_blended(exports, tmp_path):
    import mlflow

    base, ((lora_a, export_a, _), (lora_b, export_b, _)) = exports
    first = _register(tmp_path / "a", lora_a, export_a, base)
    second = _register(tmp_path / "b", lora_b, export_b, base)
    client = mlflow.MlflowClient()
    assert [str(v.version) for v in client.search_model_versions("name='sd-test-base'")] == ["1"]
    config = mlflow.models.get_model_info("models:/sd-test-base/1").flavors["python_function"]["config"]
    assert config["adapter_models"] == ["sd-test"], "its endpoint applies versions of the pipeline's own model only"
    for done in (first, second):
        tags = client.get_model_version("sd-test", done.version).tags
        assert tags["base_export.model"] == "sd-test-base" and tags["base_export.version"] == "1"
        assert tags["model.artifacts"] == "runtime_adapter"
    stored = Path(mlflow.artifacts.download_artifacts(f"{second.model_uri}/artifacts"))
    assert not list(stored.rglob("openvino_model.xml")) and not list(stored.rglob("model_index.json")), (
        "neither the base export nor the base pipeline is stored again per fine-tune")
    assert [p.parent.name for p in stored.rglob("genai_lora.safetensors")] == ["adapter"]
    # another user's own model, its lineage naming this base export's key (a public tag), digest and all
    register_adapter(tmp_path / "theirs", "intruder", 4, lineage_key=config_key(client))

    # The base export's endpoint over HTTP, as a team serves it: one server, the adapter per request.
    with models_serve("models:/sd-test-base/1", tmp_path / "serve.log") as (url, _):
        def served(spec: str) -> list[np.ndarray]:
            status, answer = post(url, {"inputs": [PROMPT], "params": {**CALL, "adapter": spec}})
            assert status == 200, (spec, answer)
            return _images({"image": [row["image"] for row in answer["predictions"]]})

        by = {spec: served(spec)[0] for spec in ("sd-test/1", "sd-test@candidate", "sd-test/1:0.5,sd-test/2:0.5", "")}
        assert np.array_equal(by["sd-test@candidate"], served("sd-test/2")[0])  # the alias names version 2
        for spec, field in (("intruder/1", "registered model 'intruder' is not one whose versions this endpoint "
                                           r"applies \(sd-test;"),
                            ("nope@champion", "registered model 'nope' is not one"),
                            ("sd-test/99", "not a registered model version"), ("sd-test", "is not <registered"),
                            ("sd-test/1:9", "out of range")):
            status, answer = post(url, {"inputs": [PROMPT], "params": {**CALL, "adapter": spec}})
            assert status == 400 and re.search(f"adapter: .*{field}", answer["message"]), (spec, status, answer)
    wanted = {"sd-test/1": ([lora_a], [1.0]), "sd-test@candidate": ([lora_b], [1.0]),
              "sd-test/1:0.5,sd-test/2:0.5": ([lora_a, lora_b], [0.5, 0.5]), "": ([], [])}
    refs = {spec: _pytorch(base, *args) for spec, args in wanted.items()}
    for spec, image in by.items():  # each nearest its PyTorch twin
        own = psnr_db(refs[spec], image)
        assert own >= 30 and own > max(psnr_db(r, image) for s, r in refs.items() if s != spec) + 3, spec


def test_a_version_for_another_base_is_refused_and_the_adapter_version_serves_alone(exports, tmp_path):
    import mlflow
    from mlflow.exceptions import MlflowException

    base, ((lora_a, export_a, _), _) = exports
    _register(tmp_path / "a", lora_a, export_a, base)
    other = tmp_path / "other-export"
    shutil.copytree(export_a, other)
    info = json.loads((other / "runtime_adapter.json").read_text())
    (other / "runtime_adapter.json").write_text(json.dumps({**info, "base_key": "f" * 64}))
    _register(tmp_path / "o", lora_a, other, base)
    client = mlflow.MlflowClient()
    assert len(client.search_model_versions("name='sd-test-base'")) == 2  # a second base export
    first = mlflow.artifacts.load_dict(f"runs:/{client.get_model_version('sd-test', '1').run_id}/lineage.json")
    assert first["base_export"] == {"key": client.get_model_version("sd-test-base", "1").tags["base_export.key"],
                                    "model": "sd-test-base", "version": "1"}
    # a tag is editable by anyone allowed to tag: retagged for base 1, version 2 is still refused
    client.set_model_version_tag("sd-test", "2", "base_export.key", first["base_export"]["key"])
    served = mlflow.pyfunc.load_model("models:/sd-test-base/1")
    with pytest.raises(MlflowException, match="adapter: sd-test/2 .*not registered for this base export "
                                              r"\(its lineage document names base export ffffffffffff"):
        served.predict([PROMPT], params={**CALL, "adapter": "sd-test/2"})
    alone = mlflow.pyfunc.load_model("models:/sd-test/1")  # its base export, fetched from sd-test-base/1
    mine = _images(alone.predict([PROMPT], params=CALL))[0]
    via_base = _images(served.predict([PROMPT], params={**CALL, "adapter": "sd-test/1"}))[0]
    assert psnr_db(via_base, mine) > 40
    with pytest.raises(MlflowException, match="adapter: this endpoint serves one fine-tune"):
        alone.predict([PROMPT], params={**CALL, "adapter": "sd-test/1"})
    with pytest.raises(MlflowException, match="guidance_scale: 1; this base export is compiled"):
        alone.predict([PROMPT], params={**CALL, "guidance_scale": 1.0})
    _rebuilt_export_matches(export_a, tmp_path / "rebuilt")


def _rebuilt_export_matches(workspace_export: Path, dst: Path) -> None:
    """What the rescore flow evaluates for a run-time adapter champion: its export rebuilt from the
    registry (adapter + base export version) generates what the workspace's export did."""
    import mlflow

    from tasks.common.genai import open_runtime_export
    from tasks.evaluate.generate import initial_latents
    from tasks.register.base_export import runtime_export_of

    adapter = Path(mlflow.artifacts.download_artifacts("models:/sd-test/1/artifacts/adapter"))
    rebuilt, pipeline = runtime_export_of(adapter, dst)
    assert (pipeline / "model_index.json").is_file() and not (rebuilt / "base_export.json").exists()
    runners = [open_runtime_export(p, 7.5) for p in (rebuilt, workspace_export)]
    per_call = runners[0].shape.images_per_call  # the shape the export was checked at
    latents = initial_latents(list(range(per_call)), runners[0], 64, 64)
    call = dict(prompt=[PROMPT], latents=latents, num_inference_steps=2, guidance_scale=7.5, output_type="np")
    mine, theirs = (runner(**call).images for runner in runners)
    assert np.array_equal(mine, theirs)


def test_a_lora_on_a_hub_base_loads_with_mlflows_diffusers_flavor(exports, tmp_path):
    """A hub base (pinned revision) gives the version MLflow's diffusers flavor beside the pyfunc;
    a built-in base does not (the flavor keeps a hub id, not weights). Loaded here with the local
    copy of the base in place of the hub (no hub from this machine)."""
    import mlflow
    import torch
    from mlflow.exceptions import MlflowException

    base, ((lora_a, export_a, _), _) = exports
    hub = {"model": "stable-diffusion-v1-5/stable-diffusion-v1-5",
           "revision": "451f4fe16113bff5a5d2269ed5ad43b0592e9a14"}
    root = tmp_path / "hub"
    root.mkdir()
    (root / "params.yaml").write_text(yaml.safe_dump({"base": hub, "register": {"model_name": "sd-hub"}}))
    (root / "dvc.lock").write_text(DVC_LOCK)
    (root / "evaluate.json").write_text(json.dumps(EVAL_PASS))
    from tasks.register.core import register

    done = register(lora_a, export_a, root / "evaluate.json", root / "dvc.lock", root / "params.yaml", base=base)
    assert mlflow.MlflowClient().get_model_version("sd-hub", done.version).tags["model.flavors"] == (
        "python_function,diffusers")
    adapter = mlflow.diffusers.load_model(done.model_uri)
    assert (adapter.base_model, adapter.base_model_revision) == (hub["model"], hub["revision"])
    pipe = adapter.load_pipeline(base_model=str(base))
    pipe.set_progress_bar_config(disable=True)
    image = pipe(PROMPT, height=64, width=64, guidance_scale=7.5, output_type="np",
                 generator=torch.Generator().manual_seed(CALL["seed"]),
                 num_inference_steps=CALL["num_inference_steps"]).images[0]
    assert psnr_db(_pytorch(base, [lora_a], [1.0]), image) > 60  # the same LoRA on the same base
    assert mlflow.pyfunc.load_model(done.model_uri).metadata.flavors.keys() >= {"python_function", "diffusers"}

    built_in = _register(tmp_path / "builtin", lora_a, export_a, base)  # params without a hub base
    with pytest.raises(MlflowException, match="diffusers"):
        mlflow.diffusers.load_model(built_in.model_uri)
