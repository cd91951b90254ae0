"""Which adapters a base export's endpoint applies: versions of the pipeline's own registered models
only (model_config `adapter_models`), whose lineage document is the registered one; lineage documents
and manifests read within a byte cap; an adapter's size checked from the store's listing before
anything is downloaded. Cheap: the real local MLflow registry and small safetensors versions, the
endpoint's predict with a stand-in pipeline (tests/runtime/test_adapter_cache.py's); GenAI applying
adapters over HTTP is test_adapter_registry.py's."""
from __future__ import annotations

import hashlib
import json
import tempfile

import mlflow
import pytest
from mlflow.exceptions import MlflowException

from finetune_runtime import registered
from finetune_runtime.adapter_cache import AdapterCache, allowed_models
from finetune_runtime.load import Loaded
from finetune_runtime.model import DiffusionImageModel
from tests.runtime.test_adapter_cache import KB, KEY, AdapterPipe, register_adapter

pytestmark = pytest.mark.quick  # make test-fast


def _no_check(_: str) -> None:
    pass


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """The endpoint of base export KEY, registered to apply versions of `sd-test` only."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    made = AdapterCache(KEY, 1000 * KB, allowed_models({"adapter_models": ["sd-test"]}))
    yield made
    made.close()


def _no_download(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any download of an adapter's files fails the test."""
    def refused(*_, **__):
        raise AssertionError("an adapter's files were downloaded")

    monkeypatch.setattr(AdapterCache, "_download", refused)


def test_another_models_adapter_gets_400_naming_the_field(cache, tmp_path, monkeypatch) -> None:
    """A reader's own model whose lineage names this base export (its key is a public tag) is refused
    by name, before anything of it is looked up; the pipeline's own model is applied."""
    src = tmp_path / "src"
    mine = register_adapter(src, "sd-test", 4)
    theirs = register_adapter(src, "intruder", 4)  # a valid lineage document naming KEY, digest and all
    model, pipe = DiffusionImageModel(), AdapterPipe(0.0, cache)
    model.serve(Loaded(pipe, "genai", "stand-in"), {"budget_images": 100, "max_waiting": 1})
    with pytest.raises(MlflowException) as info:
        model.predict(None, ["a"], {"adapter": f"intruder/{theirs}", "num_inference_steps": 2})
    assert info.value.get_http_status_code() == 400
    assert info.value.message == (
        f"adapter: intruder/{theirs}: registered model 'intruder' is not one whose versions this endpoint "
        "applies (sd-test; model_config adapter_models, params.yaml register.serve_adapter_models)")
    with pytest.raises(MlflowException, match=r"^adapter: intruder@champion: registered model 'intruder' is not one"):
        model.predict(None, ["a"], {"adapter": f"sd-test/{mine}:0.5,intruder@champion", "num_inference_steps": 2})
    assert len(model.predict(None, ["a"], {"adapter": f"sd-test/{mine}", "num_inference_steps": 2})) == 1
    assert list(cache.entries) == [f"sd-test/{mine}"], "nothing of the other model was downloaded"
    # a base export registered before the list existed applies none, and says how to fix it
    old = AdapterCache(KEY, 1000 * KB, allowed_models({}))
    with pytest.raises(ValueError, match=r"^adapter: sd-test/1: this base export was registered without the list "
                                         r"of the models whose adapters it applies \(model_config adapter_models\)"):
        old.get("sd-test", None, mine, _no_check)
    old.close()
    with pytest.raises(ValueError, match="model_config adapter_models: 'sd-test' is not a list"):
        allowed_models({"adapter_models": "sd-test"})


def test_a_lineage_document_rewritten_after_registration_is_refused(cache, tmp_path, monkeypatch) -> None:
    """The document names this base, but it is not the one registered: its SHA-256 is not the run's param."""
    version = register_adapter(tmp_path / "src", "sd-test", 4)
    client = mlflow.MlflowClient()
    mv = client.get_model_version("sd-test", version)
    client.log_text(mv.run_id, json.dumps({"model": {"name": "sd-test", "source": mv.source},
                                           "base_export": {"key": KEY}, "planted": 1}), "lineage.json")
    _no_download(monkeypatch)
    with pytest.raises(ValueError, match=rf"^adapter: sd-test/{version} \(version {version}\): its lineage document "
                                         rf"\(lineage.json in run {mv.run_id}\) was rewritten after registration"):
        cache.get("sd-test", None, version, _no_check)
    # one naming another version of the model (copied from it, digest and all) describes another version
    other = register_adapter(tmp_path / "src", "sd-test", 4, lineage={
        "model": {"name": "sd-test", "source": mv.source}, "base_export": {"key": KEY}})
    with pytest.raises(ValueError, match=rf"^adapter: sd-test/{other} .*does not describe this version"):
        cache.get("sd-test", None, other, _no_check)


def test_a_lineage_document_over_its_cap_is_refused_before_it_is_downloaded(cache, tmp_path,
                                                                           monkeypatch) -> None:
    version = register_adapter(tmp_path / "src", "sd-test", 4)
    monkeypatch.setattr(registered, "LINEAGE_MAX_BYTES", 64)
    fetched = []
    monkeypatch.setattr(mlflow.MlflowClient, "download_artifacts", lambda *a, **k: fetched.append(a))
    with pytest.raises(ValueError, match=rf"^adapter: sd-test/{version} \(version {version}\): lineage.json is "
                                         r"\d+ bytes, over the 64 bytes such a file may have"):
        cache.get("sd-test", None, version, _no_check)
    assert not fetched and not cache.entries


def test_a_manifest_over_its_cap_is_refused_naming_it(tmp_path, monkeypatch) -> None:
    from tasks.register import manifest

    client = mlflow.MlflowClient()
    run = client.create_run(mlflow.set_experiment("manifests").experiment_id).info.run_id
    source = f"runs:/{run}/model"
    key = manifest.model_key(source)
    text = json.dumps({"format": 1, "source": source, "files": {f"f{i}": "0" * 64 for i in range(50)}})
    client.log_text(run, text, f"manifests/{key}.json")
    client.log_param(run, manifest.MANIFEST_PARAM.format(key), hashlib.sha256(text.encode()).hexdigest())
    assert len(manifest.expected(client, run, source, "model x")) == 50
    monkeypatch.setattr(manifest, "MANIFEST_MAX_BYTES", 1000)
    with pytest.raises(manifest.ManifestMismatch, match=rf"^model x: manifests/{key}.json is {len(text)} bytes, "
                                                        "over the 1000 bytes such a file may have"):
        manifest.expected(client, run, source, "model x")


def test_an_adapters_size_is_checked_from_the_listing_before_the_download(cache, tmp_path, monkeypatch) -> None:
    """Over the cache, or with a size the store does not list: refused, nothing downloaded."""
    from mlflow.entities import FileInfo

    big = register_adapter(tmp_path / "src", "sd-test", 1200)
    small = register_adapter(tmp_path / "src", "sd-test", 4)
    _no_download(monkeypatch)
    with pytest.raises(ValueError, match=rf"^adapter: sd-test/{big} is 1.17 MB, more than this endpoint's adapter "
                                         r"cache holds \(0.977 MB, model_config adapter_cache_mb\)"):
        cache.get("sd-test", None, big, _no_check)
    listing = mlflow.artifacts.list_artifacts
    monkeypatch.setattr(mlflow.artifacts, "list_artifacts", lambda **kw: [
        FileInfo(f.path, f.is_dir, None if f.path.endswith(".safetensors") else f.file_size)
        for f in listing(**kw)])
    with pytest.raises(ValueError, match=rf"^adapter: sd-test/{small}: the store does not list the size of "
                                         r"\S*genai_lora.safetensors, so it cannot be checked"):
        cache.get("sd-test", None, small, _no_check)
    monkeypatch.setattr(mlflow.artifacts, "list_artifacts", lambda **kw: (
        [FileInfo(f"x{i}", False, 1) for i in range(65)] if str(kw.get("artifact_uri")).startswith("models:/")
        else listing(**kw)))
    with pytest.raises(ValueError, match=rf"^adapter: sd-test/{small}: its adapter artifact lists more than 64 files"):
        cache.get("sd-test", None, small, _no_check)
    assert not cache.entries
