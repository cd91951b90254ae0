"""An experiment workspace replaces and removes only what lies inside the worktree it made."""
from __future__ import annotations

from pathlib import Path

import pytest

from flows import experiment
from tasks.common import safe_remove
from tasks.common.errors import UserError

pytestmark = pytest.mark.quick  # make test-fast


def test_carrying_never_replaces_a_path_outside_the_worktree(tmp_path: Path) -> None:
    root, dest = tmp_path / "repo", tmp_path / "repo" / ".dvc" / "tmp" / "flow-exps" / "x"
    outside = tmp_path / "precious"
    (outside / "sub").mkdir(parents=True)
    (outside / "sub" / "f").write_text("keep")
    (root / "data").mkdir(parents=True)
    (root / "data" / "a").write_text("new")
    dest.mkdir(parents=True)
    (dest / "linked").symlink_to(outside, target_is_directory=True)
    for rel in (str(outside / "sub"), "../../../../../precious/sub", "linked/sub"):
        experiment._carry(root, dest, rel)
    assert (outside / "sub" / "f").read_text() == "keep"
    experiment._carry(root, dest, "data/a")  # inside: carried as before
    assert (dest / "data" / "a").read_text() == "new"


def test_an_experiment_name_with_a_path_in_it_is_refused(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(experiment, "require_git", lambda root: None)
    for name in ("../..", "a/b", "..", ""):
        with pytest.raises(UserError, match="plain name"), experiment.experiment_workspace(tmp_path, name, {}):
            pass
    assert not (tmp_path / experiment.EXPERIMENTS_DIR).exists()


def test_a_leftover_workspace_is_removed_only_from_the_marked_folder(tmp_path: Path) -> None:
    exps = tmp_path / experiment.EXPERIMENTS_DIR
    (exps / "flow-1").mkdir(parents=True)
    (exps / "flow-1" / ".git").write_text("gitdir: elsewhere\n")  # a worktree's .git file
    assert not safe_remove.remove_marked(exps / "flow-1", experiment.KIND, owner=exps)
    safe_remove.mark(exps, experiment.KIND)
    assert safe_remove.remove_marked(exps / "flow-1", experiment.KIND, owner=exps)
    assert not (exps / "flow-1").exists()
