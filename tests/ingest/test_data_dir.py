"""Your own images: one line of params.yaml (`ingest.data_dir`), and the real DVC reruns ingest
when files there are added, changed or removed (dvc.yaml: ingest depends on the folder's manifest,
tasks/ingest/manifest.py, which every `dvc repro` writes again); and nothing there can stall DVC:
a FIFO named like an image is rejected with its reason while `dvc repro` and `dvc status` answer
in seconds (DVC hashing the folder itself would block on it for ever)."""
from __future__ import annotations

import difflib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flows.changes import manifest_changes
from tests.e2e_util import copy_repo, e2e_env
from tests.ingest.util import picture, save


def dvc(repo: Path, *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=repo, env=e2e_env(repo),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def repro(repo: Path) -> tuple[bool, int]:
    """(whether ingest ran, images it kept). `dvc repro ingest` runs the manifest stage first."""
    out = dvc(repo, "repro", "ingest")
    assert "Running stage 'data_manifest'" in out, out
    ran = "Running stage 'ingest'" in out
    assert ran or "Stage 'ingest' didn't change, skipping" in out, out
    return ran, json.loads((repo / "reports" / "ingest.json").read_text())["kept"]


def ingest_changed(repo: Path) -> list[str] | None:
    """What the nightly sees changed in the data folder since dvc.lock (None: nothing); `dvc
    status` says `data_manifest: always changed` and nothing else meanwhile."""
    text = dvc(repo, "status", "--json")
    status = json.loads(text[text.index("{"):]) if "{" in text else {}
    assert {k: v for k, v in status.items() if k in ("data_manifest", "ingest")} == \
        {"data_manifest": ["always changed"]}, status
    return manifest_changes(repo)[1] or None


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
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    assert f'--data "{mine}"' in lock["data_manifest"]["cmd"], "dvc.lock records the folder"
    assert "reports/data_manifest.json" in [dep["path"] for dep in lock["ingest"]["deps"]]

    changed = [f"stage 'data_manifest': the data folder {mine} differs from the manifest dvc.lock "
               "records (reports/data_manifest.json): new, edited or removed files"]
    save(mine / "new" / "3.png", picture(3))  # added (in a sub-folder)
    assert ingest_changed(repo) == changed
    assert repro(repo) == (True, 4)

    save(mine / "0.png", picture(10))  # changed in place
    assert ingest_changed(repo) == changed
    (mine / "1.png").unlink()  # removed
    assert repro(repo) == (True, 3)

    assert repro(repo) == (False, 3), "nothing changed: DVC skips the stage"


@pytest.mark.e2e
def test_a_fifo_named_like_an_image_is_rejected_and_stalls_no_dvc_command(tmp_path: Path) -> None:
    """Before the manifest, `dvc status` and `dvc repro ingest` here blocked for ever (DVC opened
    the FIFO to hash the folder; both still waiting after 120 s)."""
    repo = copy_repo(tmp_path / "repo")
    rel = Path(yaml.safe_load((repo / "params.yaml").read_text())["ingest"]["data_dir"])
    data = repo / rel
    os.mkfifo(data / "evil.png")
    os.symlink("evil.png", data / "evil_link.png")

    done = subprocess.run([sys.executable, "-m", "dvc", "repro", "ingest"], cwd=repo, env=e2e_env(repo),
                          capture_output=True, text=True, timeout=300)  # within 5 minutes, or it failed
    said = done.stdout + done.stderr
    assert done.returncode == 0, said
    assert f"{rel / 'evil.png'}: a FIFO (named pipe), not a regular file: never opened, ingest rejects it " \
           "(not_regular_file); remove it, or replace it with the file itself" in said
    assert f"{rel / 'evil_link.png'}: a link to a FIFO (named pipe)" in said
    rows = [json.loads(line) for line in (repo / "reports" / "ingest_rejected.jsonl").read_text().splitlines()]
    rejected = {row["path"]: row for row in rows}
    for name in ("evil.png", "evil_link.png"):
        assert rejected[name]["reason"] == "not_regular_file", rows
        assert rejected[name]["detail"].startswith("a FIFO (named pipe), not a regular file: never opened"), rows
    assert json.loads((repo / "reports" / "ingest.json").read_text())["kept"] == 6

    assert ingest_changed(repo) is None  # `dvc status` answers, the nightly's comparison too
    assert repro(repo) == (False, 6), "the same folder, FIFO and all: ingest is skipped"
