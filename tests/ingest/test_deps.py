"""dvc.yaml must list every local source folder as a dependency of the ingest stage."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tasks.common.errors import UserError
from tasks.ingest.deps import check_dvc_deps
from tests.conftest import REPO
from tests.ingest.util import config

pytestmark = pytest.mark.quick  # make test-fast


def repo(tmp_path: Path, deps: list) -> dict[str, str]:
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump(
        {"stages": {"ingest": {"cmd": "python -m tasks.ingest", "deps": deps}}}))
    return {"DVC_STAGE": "ingest", "DVC_ROOT": str(tmp_path)}


def sources(*paths: str, hub: bool = False) -> list[dict]:
    found = [{"type": "folder", "path": p} for p in paths]
    if hub:
        found.append({"type": "hub", "name": "org/set", "revision": "0123abc"})
    return found


def test_covered_sources_pass(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    env = repo(tmp_path, ["tasks/ingest", "data/raw", {"data/more": {"hash": "md5"}}])
    cfg = config(sources("data/raw", "data/raw/sub/set", "data/more", hub=True))
    check_dvc_deps(cfg, {}, env)  # sub-folders of a dep are covered; hub sources are not deps


def test_a_missing_source_names_the_line_to_add(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    env = repo(tmp_path, ["tasks/ingest", "data/raw"])
    with pytest.raises(UserError) as err:
        check_dvc_deps(config(sources("data/raw", "data/new")), {}, env)
    assert "data/new is not a dependency of the DVC stage 'ingest'" in str(err.value)
    assert "stages.ingest.deps in dvc.yaml:\n      - data/new" in str(err.value)


def test_templated_deps_resolve_from_params(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    env = repo(tmp_path, ["${ingest.sources.0.path}"])
    params = {"ingest": {"sources": [{"type": "folder", "path": "data/x"}]}}
    check_dvc_deps(config(sources("data/x")), params, env)
    with pytest.raises(UserError):
        check_dvc_deps(config(sources("data/y")), params, env)


def test_outside_dvc_nothing_is_checked(tmp_path: Path) -> None:
    check_dvc_deps(config(sources("anything")), {}, {})


def test_the_repository_dvc_yaml_covers_the_default_sources(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    from tasks.ingest.config import IngestConfig

    cfg = IngestConfig.model_validate(params["ingest"])
    check_dvc_deps(cfg, params, {"DVC_STAGE": "ingest", "DVC_ROOT": str(REPO)})
