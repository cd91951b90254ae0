"""Checkpoint pruning deletes only checkpoints in a run folder the stage marked; unsafe folders are refused."""
from __future__ import annotations

from pathlib import Path

import pytest

from tasks.common import safe_remove
from tasks.common.config import parse_section
from tasks.common.errors import UserError
from tasks.train.checkpoints import KIND, CheckpointManager
from tasks.train.config import TrainConfig

pytestmark = pytest.mark.quick  # make test-fast


class FakeAccelerator:
    """What CheckpointManager.save asks of accelerate, on one process: a state file per save."""

    is_main_process = True

    def wait_for_everyone(self) -> None:
        pass

    def save_state(self, folder: str) -> None:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / "optimizer.bin").write_bytes(b"state")


def manager(run_dir: Path) -> CheckpointManager:
    return CheckpointManager(run_dir, total_limit=1, accelerator=FakeAccelerator(), info={})


def test_saving_marks_the_run_folder_and_prunes_its_old_checkpoints(tmp_path: Path) -> None:
    run_dir = tmp_path / "ckpt" / "0123456789abcdef"
    m = manager(run_dir)
    for step in (1, 2, 3):
        m.save(step)
    assert safe_remove.is_marked(run_dir, KIND)
    assert [p.name for p in m.checkpoints()] == ["checkpoint-3"]


def test_an_unmarked_folder_loses_nothing_to_pruning(tmp_path: Path) -> None:
    """A folder the stage did not make (here: checkpoints_dir pointed at a user's folder of the same
    names) keeps everything; a run folder from before the marker gets it at its next save."""
    run_dir = tmp_path / "mine"
    for step in (1, 2, 3):
        (run_dir / f"checkpoint-{step}").mkdir(parents=True)
        (run_dir / f"checkpoint-{step}" / "notes.txt").write_text("keep me")
    m = manager(run_dir)
    m._prune()
    assert [p.name for p in m.checkpoints()] == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (run_dir / "checkpoint-0").symlink_to(outside, target_is_directory=True)
    m.save(4)  # marks the folder; pruning now removes real checkpoint folders, never a link
    assert [p.name for p in m.checkpoints()] == ["checkpoint-0", "checkpoint-4"]
    assert outside.is_dir()


@pytest.mark.parametrize("key", ["checkpoints_dir", "disk_cache_dir"])
@pytest.mark.parametrize("value", [".", "..", "/"])
def test_a_folder_that_is_the_project_an_ancestor_or_root_is_refused(tmp_path: Path, monkeypatch, key: str,
                                                                      value: str) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=rf"train\.{key}: .*set it to one such as \.cache/"):
        parse_section("train", {key: value}, TrainConfig)
    assert getattr(parse_section("train", {key: ".cache/x"}, TrainConfig), key) == Path(".cache/x")
