"""The shared guard: markers, what is refused, and atomic outputs that never replace the project."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tasks.common import safe_remove
from tasks.common.errors import UserError
from tasks.common.outputs import atomic_dir

pytestmark = pytest.mark.quick  # make test-fast


def test_only_a_folder_with_the_marker_of_its_kind_is_removed(tmp_path: Path) -> None:
    mine, theirs, other_kind = tmp_path / "mine", tmp_path / "theirs", tmp_path / "other"
    safe_remove.mark(mine / "x", "cache")
    (theirs / "x").mkdir(parents=True)
    safe_remove.mark(other_kind, "checkpoints")
    (theirs / safe_remove.MARKER).write_text("not json")  # a look-alike file is no marker
    assert safe_remove.remove_marked(mine / "x", "cache") and not (mine / "x").exists()
    assert not safe_remove.remove_marked(theirs, "cache") and theirs.is_dir()
    assert not safe_remove.remove_marked(other_kind, "cache") and other_kind.is_dir()
    link = tmp_path / "link"
    link.symlink_to(other_kind, target_is_directory=True)
    assert not safe_remove.remove_marked(link, "checkpoints") and other_kind.is_dir()


def test_a_marked_owner_covers_only_its_direct_children(tmp_path: Path) -> None:
    owner = safe_remove.mark(tmp_path / "run", "checkpoints")
    (owner / "checkpoint-1" / "deep").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    assert not safe_remove.remove_marked(tmp_path / "elsewhere", "checkpoints", owner=owner)
    assert not safe_remove.remove_marked(owner / "checkpoint-1" / "deep", "checkpoints", owner=owner)
    assert safe_remove.remove_marked(owner / "checkpoint-1", "checkpoints", owner=owner)
    assert (tmp_path / "elsewhere").is_dir() and owner.is_dir()


def test_refusals(tmp_path: Path, monkeypatch) -> None:
    project = tmp_path / "project"
    (project / "tracked").mkdir(parents=True)
    (project / "tracked" / "f.txt").write_text("x")
    (project / "ignored").mkdir()
    monkeypatch.chdir(project)
    subprocess.run(["git", "init", "-q", "."], check=True)
    subprocess.run(["git", "add", "tracked"], check=True)
    assert "file system root" in safe_remove.refusal(Path("/"))
    assert "working directory" in safe_remove.refusal(Path("."))
    assert "working directory" in safe_remove.refusal(Path(".."))
    assert "repository" in safe_remove.refusal(safe_remove.REPO)
    assert "home directory" in safe_remove.refusal(Path("~"))
    assert "inside a .git folder" in safe_remove.refusal(Path(".git/hooks"))
    assert "tracked by git" in safe_remove.refusal(Path("tracked"))
    assert safe_remove.refusal(Path("ignored")) is None and safe_remove.refusal(Path("new/folder")) is None
    nested = tmp_path / "other-repo"
    nested.mkdir()
    subprocess.run(["git", "init", "-q", str(nested)], check=True)
    assert "git repository" in safe_remove.refusal(nested)


def test_an_output_folder_never_replaces_the_project(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "keep.txt").write_text("x")
    with pytest.raises(UserError, match="refusing to write an output folder at .*working directory"), \
            atomic_dir(Path(".")):
        pass
    assert (tmp_path / "keep.txt").is_file()
    with atomic_dir(tmp_path / "out") as tmp:
        (tmp / "a").write_text("1")
    assert (tmp_path / "out" / "a").read_text() == "1"
