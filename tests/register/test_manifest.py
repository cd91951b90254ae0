"""What was registered is what loads (tasks/register/manifest.py, verified.py), on a real SQLite
store in tmp: a small pyfunc registered in tasks/register's order (log, manifest, lineage.json,
version, lineage digest); a file of it changed, removed or added in the store, then loaded
through MLflow's own calls with the verifying `models:/` repository, is refused by name."""
from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlflow
import pytest

from tasks.register import manifest, verified
from tasks.register.registry import CHAMPION, LINEAGE_ARTIFACT, champion_of
from tests.register.manifest_model import register_echo, verifying

pytestmark = pytest.mark.quick  # make test-fast

NAME = "sd-manifest"


def register(tmp_path: Path, manifested: bool = True) -> tuple[Any, Path]:
    """Version 1 of NAME (alias champion) and the store's folder of its files."""
    mv, location = register_echo(tmp_path, NAME, manifested=manifested)
    return mv, Path(location.removeprefix("file://"))


@pytest.fixture
def checked() -> Iterator[None]:
    with verifying():
        yield


@pytest.mark.parametrize("file", ["model_code.py", "code/helper.py", "artifacts/weights.safetensors", "MLmodel"])
def test_a_changed_file_of_the_champion_is_refused_by_name(tmp_path: Path, checked: None, file: str) -> None:
    _, store = register(tmp_path)
    assert mlflow.pyfunc.load_model(f"models:/{NAME}@{CHAMPION}").predict(["a"]) == ["w1:a"]
    (store / file).write_text((store / file).read_text() + "\n# changed after registration\n")
    with pytest.raises(manifest.ManifestMismatch, match=rf"version 1: refusing to load it: {file} differs"):
        mlflow.pyfunc.load_model(f"models:/{NAME}@{CHAMPION}")


def test_a_removed_or_added_file_is_refused_and_so_is_a_rewritten_manifest(tmp_path: Path, checked: None) -> None:
    mv, store = register(tmp_path)
    copy = Path(verified.download(f"models:/{NAME}/1", str(tmp_path / "ok")))  # the re-score's download
    assert (copy / "artifacts" / "weights.safetensors").read_text() == "w1\n"
    (store / "code" / "sitecustomize.py").write_text("import os\n")
    with pytest.raises(manifest.ManifestMismatch, match="code/sitecustomize.py was not registered"):
        mlflow.pyfunc.load_model(f"models:/{NAME}/1")
    (store / "code" / "sitecustomize.py").unlink()
    (store / "artifacts" / "weights.safetensors").unlink()
    with pytest.raises(manifest.ManifestMismatch, match="artifacts/weights.safetensors is missing"):
        verified.download(f"models:/{NAME}/1", str(tmp_path / "dl"))
    # the manifest is an artifact too: rewriting it to match the change is seen through the param
    client = mlflow.MlflowClient()
    doc = client.download_artifacts(mv.run_id, f"manifests/{manifest.model_key(mv.source)}.json", str(tmp_path))
    forged = json.loads(Path(doc).read_text())
    del forged["files"]["artifacts/weights.safetensors"]
    Path(doc).write_text(json.dumps(forged))
    client.log_artifact(mv.run_id, doc, manifest.MANIFEST_DIR)
    with pytest.raises(manifest.ManifestMismatch, match=r"manifests/m-\w+\.json in run \w+ was rewritten"):
        mlflow.pyfunc.load_model(f"models:/{NAME}/1")
    with pytest.raises(Exception, match="Changing param values is not allowed"):
        client.log_param(mv.run_id, manifest.MANIFEST_PARAM.format(manifest.model_key(mv.source)), "0" * 64)


def test_the_cli_refuses_to_serve_a_changed_champion(tmp_path: Path, checked: None,
                                                     capsys: pytest.CaptureFixture) -> None:
    _, store = register(tmp_path)
    (store / "model_code.py").write_text("import os  # rewritten\n")
    with pytest.raises(SystemExit) as stop:
        verified.main(["models", "serve", "-m", f"models:/{NAME}@{CHAMPION}", "--env-manager", "local",
                       "-p", "1"])
    assert stop.value.code == 2
    assert "version 1: refusing to load it: model_code.py differs" in capsys.readouterr().err


def test_a_rewritten_lineage_document_gives_the_champion_no_score(tmp_path: Path) -> None:
    mv, _ = register(tmp_path)
    client = mlflow.MlflowClient()
    assert champion_of(client, mv, "dino").score == 0.4
    client.log_dict(mv.run_id, {"metrics": {"dino": 9.0}, "protocol": {"id": "p1"},
                                "model": {"name": NAME, "source": mv.source}}, LINEAGE_ARTIFACT)
    champion = champion_of(client, mv, "dino")
    assert champion.score is None
    assert "lineage.json in run" in champion.note and "rewritten after registration" in champion.note


def test_a_version_registered_without_a_manifest_is_refused_unless_allowed(
    tmp_path: Path, checked: None, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    register(tmp_path, manifested=False)
    monkeypatch.delenv(manifest.ALLOW_ENV, raising=False)
    with pytest.raises(manifest.ManifestMismatch, match="without a manifest.*FINETUNE_ALLOW_UNVERIFIED=1"):
        mlflow.pyfunc.load_model(f"models:/{NAME}/1")
    monkeypatch.setenv(manifest.ALLOW_ENV, "1")
    with caplog.at_level(logging.WARNING, logger="tasks.register.manifest"):
        assert mlflow.pyfunc.load_model(f"models:/{NAME}/1").predict(["b"]) == ["w1:b"]
    assert "registered without a manifest" in caplog.text and "loading it unchecked" in caplog.text
