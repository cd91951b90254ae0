"""Two machines sharing one DVC remote, as two clones of the toy project (tests/flows/conftest.py)
and a local-directory remote: the flow on machine A pushes what it produced; on machine B (a new
clone, an empty cache) the flow pulls what it needs and runs nothing. Inputs another clone could
not get, and a push that fails, stop the flow with the fix; a run with overrides (a DVC
experiment in a worktree of its own) pushes too. The real pipeline on the team stack:
tests/infra/test_team_stack.py."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
import yaml

import flows.finetune as finetune_module
from flows.changes import _status_reasons
from flows.dvc_stage import dvc_status
from flows.remote import REMOTE_TAG, default_remote
from tasks.common.errors import UserError
from tests.flows.conftest import git

COMMIT = ["-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-q", "-m"]


def dvc(root: Path, *args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=root, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def team_toy(toy: Path, remote: Path, track: bool = True) -> Path:
    """The toy with a folder of inputs (`dvc add`ed when `track`) and a default DVC remote."""
    (toy / "photos").mkdir()
    (toy / "photos/a.txt").write_text("a photo")
    spec = yaml.safe_load((toy / "dvc.yaml").read_text())
    spec["stages"]["second"]["deps"].append("photos")
    (toy / "dvc.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    if track:
        dvc(toy, "add", "-q", "photos")
    else:
        (toy / ".gitignore").write_text((toy / ".gitignore").read_text() + "/photos/\n")
    dvc(toy, "remote", "add", "-d", "team", str(remote))
    dvc(toy, "remote", "modify", "team", "verify", "true")
    git(toy, "add", "-A")
    git(toy, *COMMIT, "team set-up")
    return toy


def clone(origin: Path, dest: Path, monkeypatch: pytest.MonkeyPatch, rev: str = "HEAD") -> Path:
    """Another machine: a git clone of `origin` at `rev` (its own, empty DVC cache); the flow
    runs there from now on."""
    subprocess.run(["git", "clone", "-q", str(origin), str(dest)], check=True)
    git(dest, "checkout", "-q", rev)
    monkeypatch.setattr(finetune_module, "REPO", dest)
    return dest


def files(root: Path) -> dict[str, str]:
    names = ["second.out", "first.out", "photos/a.txt"]
    return {n: (root / n).read_text() for n in names if (root / n).exists()}


def test_machine_b_pulls_what_machine_a_pushed_and_runs_nothing(
        prefect_server, toy: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    remote = tmp_path / "remote"
    a = team_toy(toy, remote)
    assert default_remote(a).describe() == f"team {remote}"

    first = finetune_module.finetune(register_model=False)
    assert [s["status"] for s in first["stages"]] == ["ran", "ran"]
    assert first["dvc_remote"] == f"team {remote}"
    parent = mlflow.MlflowClient().get_run(first["mlflow_run_id"])
    assert parent.data.tags[REMOTE_TAG] == f"team {remote}"
    assert (remote / "runs").is_dir(), "the run-cache was not pushed"
    # Everything dvc.lock and photos.dvc name is on the remote: a status against it finds nothing.
    assert "new:" not in dvc(a, "status", "--cloud")
    before_lock = git(a, "rev-parse", "HEAD").strip()
    git(a, "add", "dvc.lock", ".gitignore")
    git(a, *COMMIT, "the run's dvc.lock")  # what a team shares in git after a run

    # Machine B: a clone with dvc.lock, no data, no cache.
    b = clone(a, tmp_path / "b", monkeypatch)
    assert files(b) == {}
    missing = dvc_status(b)
    assert _status_reasons(missing) and not _status_reasons(missing, allow_missing=True)
    pulled = finetune_module.finetune(register_model=False)
    assert [(s["stage"], s["status"]) for s in pulled["stages"]] == [("second", "pulled"),
                                                                      ("first", "pulled")]
    assert files(b) == files(a)
    assert not list(b.glob("*.attempts")), "a stage ran on machine B"
    assert dvc_status(b) == {}

    # Machine C: a clone from before dvc.lock was committed. The stages have no lock to compare
    # with; the run-cache machine A pushed is not trusted (anyone with the remote's keys could
    # have written it: tests/flows/test_forged.py), so they run, and make the same files.
    c = clone(a, tmp_path / "c", monkeypatch, rev=before_lock)
    rerun = finetune_module.finetune(register_model=False)
    assert [s["status"] for s in rerun["stages"]] == ["ran", "ran"]
    assert files(c) == files(a) and dvc_status(c) == {}


def test_an_input_no_clone_could_get_stops_the_flow_before_it_runs(
        prefect_server, toy: Path, tmp_path: Path) -> None:
    team_toy(toy, tmp_path / "remote", track=False)  # photos/ is ignored by git, not in DVC
    with pytest.raises(UserError, match="photos is tracked by neither git nor DVC") as err:
        finetune_module.finetune(register_model=False)
    assert "dvc add photos && git add photos.dvc" in str(err.value)
    assert not (toy / "second.attempts").exists()
    assert mlflow.search_runs(search_all_experiments=True, output_format="list") == []


def test_inputs_changed_without_dvc_add_stop_the_flow(
        prefect_server, toy: Path, tmp_path: Path) -> None:
    team_toy(toy, tmp_path / "remote")
    (toy / "photos/b.txt").write_text("a new photo")  # not recorded in photos.dvc
    with pytest.raises(UserError, match="photos has changes that photos.dvc does not record"):
        finetune_module.finetune(register_model=False)
    assert not (toy / "second.attempts").exists() and (toy / "photos/b.txt").exists()


def test_a_failed_push_fails_the_run(prefect_server, toy: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    team_toy(toy, blocker / "remote")  # no folder can be made under a file, not even by root
    with pytest.raises(UserError, match="`dvc push` to DVC remote team .* failed, so nothing "
                                        "was registered"):
        finetune_module.finetune(register_model=False)
    (parent,) = mlflow.search_runs(search_all_experiments=True, output_format="list",
                                   filter_string="tags.pipeline = 'finetune'")
    assert parent.info.status == "FAILED" and REMOTE_TAG not in parent.data.tags


def test_an_experiment_pushes_its_outputs_too(prefect_server, toy: Path, tmp_path: Path) -> None:
    """Overrides run in a worktree of their own (flows/experiment.py); what they produce reaches
    the remote all the same, so the version they register can name it."""
    import hashlib

    remote = tmp_path / "remote"
    team_toy(toy, remote)
    result = finetune_module.finetune(overrides={"first.value": 5}, register_model=False)
    assert result["dvc_experiment"] and result["dvc_remote"] == f"team {remote}"
    md5 = hashlib.md5(b"5").hexdigest()  # the experiment's first.out
    assert (remote / "files/md5" / md5[:2] / md5[2:]).is_file()
    assert not (toy / "first.out").exists()  # the workspace is left alone
