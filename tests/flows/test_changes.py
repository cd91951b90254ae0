"""`only_if_changed`'s decision on a throw-away DVC project with the real `dvc` and a real MLflow
registry (versions carry the lineage tags tasks/register writes)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
import yaml

from flows.changes import _status_reasons, detect_changes, lineage_of_workspace, unwatched_sources
from tasks.register.lineage import fingerprint

INGEST = "import pathlib, shutil; shutil.copytree('src', 'processed', dirs_exist_ok=True)"
PARAMS = ("ingest:\n  sources:\n    - type: folder\n      path: src\n  resolution: 64\n"
          "register:\n  model_name: toy\n")


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    root = tmp_path / "ws"
    (root / "src").mkdir(parents=True)
    (root / "src/a.png").write_bytes(b"a")
    subprocess.run([sys.executable, "-m", "dvc", "init", "--no-scm", "-q"], cwd=root, check=True)
    stages = {"ingest": {"cmd": f'python -c "{INGEST}"', "deps": ["src"],
                         "params": ["ingest"], "outs": ["processed"]}}
    (root / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}, width=1000))
    (root / "params.yaml").write_text(PARAMS)
    subprocess.run([sys.executable, "-m", "dvc", "repro", "-q"], cwd=root, check=True)
    return root


def _register(root: Path, uri: str) -> str:
    """A version of `toy` with the workspace's lineage, as tasks/register leaves it: the
    fingerprint tag, and lineage.json in its run."""
    client = mlflow.MlflowClient(tracking_uri=uri)
    if not client.search_registered_models("name='toy'"):
        client.create_registered_model("toy")
    built_from = lineage_of_workspace(root)
    run = client.create_run(client.get_experiment_by_name("Default").experiment_id)
    tags = {"lineage.fingerprint": fingerprint(built_from), "git_commit": "x",
            "lineage": f"runs:/{run.info.run_id}/lineage.json"}
    version = client.create_model_version("toy", source=str(root / "processed"), tags=tags,
                                          run_id=run.info.run_id).version
    owner = {"name": "toy", "version": version, "run_id": run.info.run_id}  # the document names it
    client.log_dict(run.info.run_id, {"inputs": built_from, "model": owner}, "lineage.json")
    return version


def _repro(root: Path) -> None:
    subprocess.run([sys.executable, "-m", "dvc", "repro", "-q"], cwd=root, check=True)


def test_changes_against_the_last_registered_version(ws: Path, isolated_mlflow: str) -> None:
    """One workspace through the nightly's situations (each `dvc` call costs seconds)."""
    changes = detect_changes(ws, "toy", isolated_mlflow)
    assert changes.changed and changes.compared_with is None
    assert changes.reasons == ["no version of model 'toy' is registered yet"]

    version = _register(ws, isolated_mlflow)
    changes = detect_changes(ws, "toy", isolated_mlflow)
    assert not changes.changed, changes.reasons
    assert changes.summary() == f"up to date: nothing changed since toy v{version}"

    (ws / "src/b.png").write_bytes(b"b")  # a new image in the source folder
    changes = detect_changes(ws, "toy", isolated_mlflow)
    assert changes.changed and changes.compared_with == "toy v1"
    assert changes.reasons == ["stage 'ingest': changed deps: src modified"]

    # `dvc status` is clean after a plain `dvc repro`, but the registry still has older lineage.
    _repro(ws)
    (reason,) = detect_changes(ws, "toy", isolated_mlflow).reasons
    assert reason.startswith("dvc.lock differs from the lineage of toy v1: dvc.md5.processed: ")

    assert str(_register(ws, isolated_mlflow)) == "2"  # the newest version is the one compared with
    assert not detect_changes(ws, "toy", isolated_mlflow).changed

    # Its registration cut off after the version was created (tasks/register/resume.py): the
    # nightly runs, and the registration finishes v2 (tests/register/test_resume.py).
    mlflow.MlflowClient(tracking_uri=isolated_mlflow).set_model_version_tag("toy", "2", "registration", "incomplete")
    changes = detect_changes(ws, "toy", isolated_mlflow)
    assert changes.changed and changes.reasons == [
        "the registration of toy v2 was cut off after the version was created (tag "
        "registration=incomplete); this run finishes it"]


def test_a_version_built_by_an_experiment_is_not_the_workspace_baseline(
        ws: Path, isolated_mlflow: str) -> None:
    """A flow run with overrides (a DVC experiment) registers a version the nightly must not
    compare the workspace with: it was not built from the workspace's params.yaml."""
    _register(ws, isolated_mlflow)
    client = mlflow.MlflowClient(tracking_uri=isolated_mlflow)
    client.create_model_version("toy", source=str(ws / "processed"), tags={
        "dvc.experiment": "flow-x", "param.ingest.resolution": "128", "dvc.md5.processed": "y"})
    changes = detect_changes(ws, "toy", isolated_mlflow)
    assert not changes.changed and changes.compared_with == "toy v1"
    with_exps = detect_changes(ws, "toy", isolated_mlflow, include_experiments=True)
    assert with_exps.changed and with_exps.compared_with == "toy v2"


def test_a_changed_param_is_a_change(ws: Path, isolated_mlflow: str) -> None:
    _register(ws, isolated_mlflow)
    (ws / "params.yaml").write_text(PARAMS.replace("resolution: 64", "resolution: 128"))
    changes = detect_changes(ws, "toy", isolated_mlflow)
    assert changes.changed and "stage 'ingest': changed deps: params.yaml" in changes.reasons[0]


def test_a_source_folder_dvc_does_not_watch_is_reported(ws: Path, isolated_mlflow: str) -> None:
    (ws / "params.yaml").write_text(PARAMS.replace(
        "      path: src\n", "      path: src\n    - type: folder\n      path: more/\n"
        "    - type: hub\n      path: org/dataset\n"))
    _repro(ws)
    _register(ws, isolated_mlflow)
    assert unwatched_sources(ws) == ["more"]
    changes = detect_changes(ws, "toy", isolated_mlflow)
    assert changes.changed
    assert changes.reasons[0].startswith("source folder more is not a dependency of any stage")


def test_the_data_dir_dependency_is_read_as_dvc_fills_it_in(tmp_path: Path) -> None:
    """dvc.yaml's `${ingest.data_dir}` watches a source that has no `path` of its own."""
    (tmp_path / "params.yaml").write_text(
        "ingest:\n  data_dir: photos\n  sources:\n    - type: folder\n"
        "    - type: folder\n      path: photos/more\n")
    stages = {"ingest": {"cmd": "true", "deps": ["tasks/ingest", "${ingest.data_dir}"]}}
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}))
    assert unwatched_sources(tmp_path) == []
    stages["ingest"]["deps"] = ["tasks/ingest", "data/other"]
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}))
    assert unwatched_sources(tmp_path) == ["photos", "photos/more"]


def test_a_forged_fingerprint_tag_does_not_make_the_nightly_up_to_date(
        ws: Path, isolated_mlflow: str) -> None:
    """Anyone who may tag a version could set its `lineage.fingerprint` (and its `lineage` link) to
    match the workspace, and the nightly would never retrain: it reads the lineage document in the
    version's own run instead, and names the tag that disagrees."""
    version = _register(ws, isolated_mlflow)
    registered_fp = fingerprint(lineage_of_workspace(ws))
    (ws / "src/b.png").write_bytes(b"b")
    _repro(ws)  # `dvc status` is clean; the registered lineage is older than dvc.lock
    now = lineage_of_workspace(ws)
    client = mlflow.MlflowClient(tracking_uri=isolated_mlflow)
    forged_run = client.create_run(client.get_experiment_by_name("Default").experiment_id)
    client.log_dict(forged_run.info.run_id, {"inputs": now}, "lineage.json")
    client.set_model_version_tag("toy", version, "lineage.fingerprint", fingerprint(now))
    client.set_model_version_tag("toy", version, "lineage", f"runs:/{forged_run.info.run_id}/lineage.json")
    changes = detect_changes(ws, "toy", isolated_mlflow)
    assert changes.changed
    (reason,) = changes.reasons
    assert reason.startswith("dvc.lock differs from the lineage of toy v1: dvc.md5.processed: ")
    assert changes.notes == [f"toy v1's tag lineage.fingerprint={fingerprint(now)} disagrees with "
                             f"its lineage document ({registered_fp}); the document is used"]
    assert changes.summary().endswith(f"(note: {changes.notes[0]})")

    # A version whose run holds no lineage document (registered before it existed): what it was
    # built from is unknown, whatever its tag says, so the nightly retrains.
    empty_run = client.create_run(client.get_experiment_by_name("Default").experiment_id)
    client.create_model_version("toy", source=str(ws / "processed"), run_id=empty_run.info.run_id,
                                tags={"lineage.fingerprint": fingerprint(now)})
    changes = detect_changes(ws, "toy", isolated_mlflow)
    assert changes.changed and changes.reasons == [
        f"what toy v2 was built from is unknown: registered without a lineage document "
        f"(lineage.json is not in run {empty_run.info.run_id})"]


def test_changed_params_are_a_change_also_when_missing_data_is_not() -> None:
    # `dvc status` names a params file's changed keys in a dict: with a DVC remote
    # (allow_missing), the nightly check read that dict as a status word and crashed.
    status = {"train": [{"changed deps": {"params.yaml": {"train.seed": "modified"},
                                          "data/processed": "deleted"}},
                        {"changed outs": {"models/finetuned": "not in cache"}}]}
    assert _status_reasons(status, allow_missing=True) == [
        "stage 'train': changed deps: params.yaml {'train.seed': 'modified'}"]
    assert _status_reasons({"ingest": [{"changed outs": {"data/processed": "deleted"}}]},
                           allow_missing=True) == []
