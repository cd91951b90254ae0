"""A registration cut off after its version was created (the worker killed between the writes
that follow `create_model_version`) is finished by the next registration of the same inputs:
one version, its lineage naming it, its aliases moved, its digest recorded, its tag `complete`
(tasks/register/resume.py). The nightly's side: tests/flows/test_changes.py; under real kills:
benchmarks/chaos."""
from __future__ import annotations

from pathlib import Path

import mlflow
import pytest

from tasks.register import core, manifest, resume
from tasks.register.core import register
from tasks.register.registry import read_lineage


class Killed(BaseException):
    """The process's death at one point of the registration (nothing after it runs)."""


def _die_at(monkeypatch: pytest.MonkeyPatch, module: object, name: str, after: bool) -> None:
    """`module.name` dies when called: after its write (`after`) or before it."""
    original = getattr(module, name)

    def die(*args, **kwargs):
        if after:
            original(*args, **kwargs)
        raise Killed(name)

    monkeypatch.setattr(module, name, die)


def _register(project: Path):
    return register(project / "models/finetuned", project / "models/openvino",
                    project / "reports/evaluate.json", project / "dvc.lock", project / "params.yaml")


@pytest.mark.parametrize("module, point, after", [
    (core, "create_version", True),    # the version exists; its lineage document names no version yet
    (core, "move_aliases", True),      # lineage and aliases done; the lineage digest not recorded
    (resume, "mark_complete", False),  # every write but the tag
], ids=["after-create", "after-aliases", "before-the-tag"])
def test_the_next_registration_finishes_a_cut_off_one(project: Path, monkeypatch: pytest.MonkeyPatch,
                                                      module: object, point: str, after: bool) -> None:
    client = mlflow.MlflowClient()
    with monkeypatch.context() as m:
        _die_at(m, module, point, after)
        with pytest.raises(Killed):
            _register(project)
    (cut,) = client.search_model_versions("name='sd-test'")
    assert cut.tags["registration"] == "incomplete"
    assert client.get_run(cut.run_id).info.status == "FAILED"

    result = _register(project)
    assert [str(v.version) for v in client.search_model_versions("name='sd-test'")] == ["1"], "not registered twice"
    assert (result.version, result.run_id, result.aliases) == ("1", cut.run_id, ("candidate", "champion"))
    version = client.get_model_version("sd-test", "1")
    assert version.tags["registration"] == "complete"
    assert {a: str(client.get_model_version_by_alias("sd-test", a).version) for a in ("candidate", "champion")} \
        == {"candidate": "1", "champion": "1"}
    doc, problem = read_lineage(client, version)  # names v1, and matches its recorded digest
    assert problem == "" and doc["model"]["version"] == "1" and doc["champion"]["champion.promoted"] == "true"
    assert manifest.LINEAGE_PARAM.format(manifest.model_key(version.source)) in client.get_run(cut.run_id).data.params


def test_a_finished_version_is_not_touched_and_new_inputs_register_anew(project: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a version tagged incomplete with the same inputs is finished: a complete one is left
    as it is, and so is an incomplete one built from other inputs (a new version is made)."""
    client = mlflow.MlflowClient()
    assert _register(project).version == "1"
    assert _register(project).version == "2", "a complete version is never reopened"
    client.set_model_version_tag("sd-test", "2", "registration", "incomplete")
    lock = project / "dvc.lock"
    lock.write_text(lock.read_text().replace("33333333333333333333333333333333.dir",
                                             "55555555555555555555555555555555.dir"))
    assert _register(project).version == "3", "other inputs: v2 is not theirs to finish"
    assert client.get_model_version("sd-test", "3").tags["registration"] == "complete"
