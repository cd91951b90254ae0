"""The stage runner on a throw-away DVC project, with the real `dvc repro --single-item`."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flows.dvc_stage import StageFailed, classify, repro

MAKE = "import sys, pathlib; pathlib.Path('out.txt').write_text(sys.prefix + open('in.txt').read())"
BROKEN = "import sys; print('reading params'); sys.exit('error: params.yaml: train.seed: bad value')"
DVC_YAML = {
    "stages": {
        "make": {"cmd": f'python -c "{MAKE}"', "deps": ["in.txt"], "outs": ["out.txt"]},
        "broken": {"cmd": f'python -c "{BROKEN}"'},
    }
}


@pytest.fixture
def project(tmp_path: Path) -> Path:
    subprocess.run([sys.executable, "-m", "dvc", "init", "--no-scm", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump(DVC_YAML, width=1000))
    (tmp_path / "in.txt").write_text("one")
    return tmp_path


def test_ran_then_skipped_then_restored_from_run_cache(project: Path) -> None:
    lines: list[str] = []
    first = repro("make", project, log=lines.append)
    assert first.status == "ran"
    assert "Running stage 'make':" in lines
    # `python` in dvc.yaml is this venv's interpreter, even though PATH was not set up for it.
    assert (project / "out.txt").read_text() == sys.prefix + "one"

    assert repro("make", project).status == "skipped"

    (project / "in.txt").write_text("two")
    assert repro("make", project).status == "ran"
    (project / "in.txt").write_text("one")  # back to a state DVC has seen: its run-cache has it
    assert repro("make", project).status == "restored"
    assert (project / "out.txt").read_text() == sys.prefix + "one"


def test_failure_names_the_stage_and_quotes_dvc(project: Path) -> None:
    with pytest.raises(StageFailed) as err:
        repro("broken", project)
    message = str(err.value)
    assert message.startswith("stage 'broken' failed")
    assert "error: params.yaml: train.seed: bad value" in message  # the stage's own error
    assert "reading params" in message
    assert err.value.returncode != 0 and not err.value.killed


def test_killed_stage_counts_as_killed() -> None:
    assert StageFailed("train", -9, []).killed
    assert StageFailed("train", 137, []).killed
    assert not StageFailed("train", 2, []).killed


def test_classify_reads_only_the_named_stage() -> None:
    lines = ["Stage 'base' didn't change, skipping", "Running stage 'ingest':"]
    assert classify("base", lines) == "skipped"
    assert classify("ingest", lines) == "ran"
    with pytest.raises(RuntimeError, match="no verdict for stage 'train'"):
        classify("train", lines)
