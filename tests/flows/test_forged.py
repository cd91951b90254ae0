"""Stage results forged from a laptop are not restored by the worker's pulls (infra/README.md,
"Who can write where"). A toy `evaluate` stage writes a failing gate; a laptop holding the
remote's keys pushes what would pass: a run-cache entry of its own making, or a rewritten object
under the genuine md5. The worker's `repro(pull=True)` (the real `dvc repro --pull`, as the
flow runs it) runs the stage instead of restoring either. Plain DVC and git, no server."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flows.dvc_stage import repro
from flows.remote import Remote, check_verify
from tasks.common.errors import UserError

pytestmark = pytest.mark.quick

GATE = "import json; open('gate.json', 'w').write(json.dumps({'passed': False}))"
FORGED = json.dumps({"passed": True})
GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com"]


def sh(root: Path, *argv: str) -> str:
    proc = subprocess.run(list(argv), cwd=root, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def dvc(root: Path, *args: str) -> str:
    return sh(root, sys.executable, "-m", "dvc", *args)


@pytest.fixture(scope="module")
def team_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The team's repository (its evaluate run, dvc.lock committed, pushed) in origin/ and its remote
    in remote/ beside it, made once per module (a dozen `dvc` processes): origin names the remote by
    a relative path, so each copy of the folder is a team of its own."""
    base = tmp_path_factory.mktemp("team")
    origin = base / "origin"
    origin.mkdir()
    sh(origin, "git", "init", "-q")
    dvc(origin, "init", "-q")
    (origin / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"evaluate": {
        "cmd": f'python -c "{GATE}"', "deps": ["in.txt"], "outs": ["gate.json"]}}}, width=1000))
    (origin / "in.txt").write_text("one")
    dvc(origin, "remote", "add", "-d", "team", "../remote")
    dvc(origin, "remote", "modify", "team", "verify", "true")
    dvc(origin, "repro", "-q")
    dvc(origin, "push", "--run-cache", "-q")
    sh(origin, "git", "add", "-A")
    sh(origin, *GIT, "commit", "-q", "-m", "evaluate ran")
    return base


@pytest.fixture
def team(team_template: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the team's repository and its remote, for this test alone."""
    for name in ("origin", "remote"):
        shutil.copytree(team_template / name, tmp_path / name, symlinks=True)
    return tmp_path / "origin", tmp_path / "remote"


def machine(origin: Path, name: str, data: str) -> Path:
    dest = origin.parent / name
    sh(origin.parent, "git", "clone", "-q", str(origin), str(dest))
    (dest / "in.txt").write_text(data)
    return dest


def test_a_forged_run_cache_entry_is_not_restored(team: tuple[Path, Path]) -> None:
    origin, remote = team
    # The laptop runs evaluate on new data, rewrites its report, records that as the run
    # (`dvc commit -f` saves a run-cache entry) and pushes the entry: md5s all match.
    laptop = machine(origin, "laptop", "two")
    dvc(laptop, "repro", "-q")
    for entry in (laptop / ".dvc/cache/runs").rglob("*"):
        if entry.is_file():
            entry.unlink()  # keep only the forged entry
    (laptop / "gate.json").write_text(FORGED)
    dvc(laptop, "commit", "-f", "-q")
    dvc(laptop, "push", "--run-cache", "-q")
    assert len([p for p in (remote / "runs").rglob("*") if p.is_file()]) == 2

    # Plain `dvc repro --pull` would restore the forgery (what the flow ran before).
    plain = machine(origin, "plain", "two")
    assert "is cached - skipping run" in dvc(plain, "repro", "--single-item", "--pull", "evaluate")
    assert json.loads((plain / "gate.json").read_text()) == {"passed": True}

    worker = machine(origin, "worker", "two")
    assert repro("evaluate", worker, log=lambda _: None, pull=True).status == "ran"
    assert json.loads((worker / "gate.json").read_text()) == {"passed": False}


def test_a_rewritten_object_fails_verification_and_the_stage_runs(team: tuple[Path, Path]) -> None:
    origin, remote = team
    md5 = yaml.safe_load((origin / "dvc.lock").read_text())["stages"]["evaluate"]["outs"][0]["md5"]
    stored = remote / "files/md5" / md5[:2] / md5[2:]
    stored.write_text(FORGED)  # a laptop's upload under the genuine name
    lines: list[str] = []
    worker = machine(origin, "worker", "one")  # dvc.lock matches: the report would be pulled
    assert repro("evaluate", worker, log=lines.append, pull=True).status == "ran"
    assert any("Unable to pull data for stage: 'evaluate'" in line for line in lines), lines
    assert json.loads((worker / "gate.json").read_text()) == {"passed": False}


def test_a_remote_that_does_not_verify_is_refused_with_the_fix() -> None:
    check_verify(Remote("team", "s3://dvc/cache", verify=True))
    with pytest.raises(UserError, match="does not verify what it pulls") as err:
        check_verify(Remote("team", "s3://dvc/cache"))
    assert "dvc remote modify team verify true" in str(err.value)
