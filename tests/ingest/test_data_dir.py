"""Your own images: one line of params.yaml (`ingest.data_dir`), and the real DVC reruns ingest
when files there are added, changed or removed (dvc.yaml depends on `${ingest.data_dir}`)."""
from __future__ import annotations

import difflib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.e2e_util import copy_repo, e2e_env
from tests.ingest.util import picture, save


def dvc(repo: Path, *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=repo, env=e2e_env(repo),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def repro(repo: Path) -> tuple[bool, int]:
    """(whether ingest ran, images it kept)."""
    out = dvc(repo, "repro", "--single-item", "ingest")
    ran = "Running stage 'ingest'" in out
    assert ran or "Stage 'ingest' didn't change, skipping" in out, out
    return ran, json.loads((repo / "reports" / "ingest.json").read_text())["kept"]


def ingest_changed(repo: Path) -> dict | None:
    """What `dvc status` says changed in the ingest stage (None: up to date)."""
    text = dvc(repo, "status", "--json", "ingest")
    status = json.loads(text[text.index("{"):]) if "{" in text else {}
    return status.get("ingest")


@pytest.mark.e2e
def test_one_line_points_dvc_at_your_images_and_changes_there_rerun_ingest(tmp_path: Path) -> None:
    repo = copy_repo(tmp_path / "repo")
    mine = tmp_path / "my images"  # outside the repository, with a space in its name
    for seed in range(3):
        save(mine / f"{seed}.png", picture(seed))

    params = repo / "params.yaml"
    before = params.read_text()
    after = re.sub(r"^  data_dir: .*$", f"  data_dir: {mine}", before, count=1, flags=re.M)
    changed = [line for line in difflib.unified_diff(before.splitlines(), after.splitlines(), n=0)
               if line.startswith(("+", "-")) and not line.startswith(("+++", "---"))]
    assert len(changed) == 2, "one line replaced, nothing else"
    params.write_text(after)

    assert repro(repo) == (True, 3)
    assert ingest_changed(repo) is None
    deps = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]["ingest"]["deps"]
    assert str(mine) in [dep["path"] for dep in deps], "dvc.lock records the folder as a dependency"

    save(mine / "new" / "3.png", picture(3))  # added (in a sub-folder)
    assert ingest_changed(repo) == [{"changed deps": {str(mine): "modified"}}]
    assert repro(repo) == (True, 4)

    save(mine / "0.png", picture(10))  # changed in place
    assert ingest_changed(repo) == [{"changed deps": {str(mine): "modified"}}]
    (mine / "1.png").unlink()  # removed
    assert repro(repo) == (True, 3)

    assert repro(repo) == (False, 3), "nothing changed: DVC skips the stage"
