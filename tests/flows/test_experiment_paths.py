"""An experiment's worktree gets every path the project's real dvc.yaml names, as DVC reads it:
`${ingest.data_dir}` filled in from params.yaml with the overrides applied (issue 45: the git-
ignored subject folder was never carried over, and ingest failed in the experiment)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flows import experiment
from tasks.common.errors import UserError
from tests.conftest import REPO

pytestmark = pytest.mark.quick  # make test-fast


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True).stdout


def _images(folder: Path) -> None:
    folder.mkdir(parents=True)
    (folder / "toy.png").write_bytes(b"\x89PNG\r\n\x1a\n not really an image")
    (folder / "toy.txt").write_text("a photo of sks toy\n")


@pytest.fixture(scope="module")
def project_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's dvc.yaml, params.yaml and .gitignore in a fresh git + DVC repository, with
    a tiny subject folder where params.yaml's ingest.data_dir points, and a second one (made once
    per module: `dvc init` is a process of its own)."""
    root = tmp_path_factory.mktemp("template") / "project"
    root.mkdir()
    for name in ("dvc.yaml", "params.yaml", ".gitignore"):
        shutil.copy(REPO / name, root / name)
    with (root / ".gitignore").open("a") as f:
        f.write("/data/mine/\n")
    _git(root, "init", "-q")
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=root, check=True)
    data_dir = yaml.safe_load((root / "params.yaml").read_text())["ingest"]["data_dir"]
    _images(root / data_dir)
    _images(root / "data" / "mine")
    _git(root, "add", "-A")
    _git(root, "-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-q", "-m", "init")
    assert _git(root, "ls-files", data_dir, "data/mine") == ""  # git ignores both: only a copy brings them
    return root


@pytest.fixture
def project(project_template: Path, tmp_path: Path) -> Path:
    """A copy of the project repository for this test alone."""
    return shutil.copytree(project_template, tmp_path / "project", symlinks=True)


def test_pipeline_paths_are_read_as_dvc_interpolates_them(project: Path) -> None:
    paths, linkable = experiment._pipeline_paths(project)
    assert "data/demo/subject" in paths  # ${ingest.data_dir}, filled in from params.yaml
    assert not [p for p in paths if "${" in p]
    assert "params.yaml" not in paths  # params are not paths to carry
    assert {"models/base", "data/processed", "data/class_images", "reports/evaluate.json"} <= set(paths)
    # persistent ones too (models/finetuned, data/class_images): DVC un-links their files before the stage runs
    assert {"models/base", "data/processed", "models/finetuned", "data/class_images"} <= linkable
    assert not linkable & {"reports/evaluate.json", "reports/evaluate", "reports/train.json"}  # metric, plot


@pytest.mark.parametrize(("overrides", "carried", "not_carried"), [
    ({}, "data/demo/subject", "data/mine"),
    ({"ingest.data_dir": "data/mine"}, "data/mine", "data/demo/subject"),
])
def test_the_experiment_gets_the_data_folder_params_yaml_names(
        project: Path, overrides: dict, carried: str, not_carried: str) -> None:
    with experiment.experiment_workspace(project, "flow-test", overrides) as dest:
        assert (dest / carried / "toy.png").read_bytes() == (project / carried / "toy.png").read_bytes()
        assert not (dest / not_carried).exists()
        params = yaml.safe_load((dest / "params.yaml").read_text())
        assert params["ingest"]["data_dir"] == carried
    assert not dest.exists()


def test_a_pipeline_dvc_cannot_resolve_fails_naming_the_fix(project: Path) -> None:
    (project / "dvc.yaml").write_text((project / "dvc.yaml").read_text().replace(
        "${ingest.data_dir}", "${ingest.no_such_key}"))
    with pytest.raises(UserError, match=r"DVC cannot read the pipeline.*no_such_key.*Fix dvc.yaml"):
        experiment._pipeline_paths(project)
