"""Checkpoints on disk: a save reaches the disk before its final name, `latest` passes over a damaged
checkpoint, a crash's `.partial` folder goes at the next start; pruning and that removal delete only in
a run folder the stage marked; unsafe folders are refused."""
from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import pytest

from tasks.common import safe_remove
from tasks.common.config import parse_section
from tasks.common.errors import UserError
from tasks.train import checkpoint_files
from tasks.train.checkpoints import KIND, CheckpointManager, TrainState
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


def manager(run_dir: Path, total_limit: int | None = 1) -> CheckpointManager:
    return CheckpointManager(run_dir, total_limit=total_limit, accelerator=FakeAccelerator(), info={})


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


def test_a_save_reaches_the_disk_before_it_takes_its_final_name(tmp_path: Path, disk_syncs: list) -> None:
    """Every file of the `.partial` folder is flushed, then the folder, then it is renamed, then the rename
    is flushed (the run folder): a power cut leaves no `checkpoint-<step>` with data missing."""
    run_dir = tmp_path / "ckpt" / "0123456789abcdef"
    m = manager(run_dir)
    m.track({"train": TrainState(step=1, history=[[1, 0.5, 1e-4]])})
    final = m.save(1)
    checkpoint_files.verify(final, m.key)  # complete: every file its manifest lists, unchanged
    run, partial = os.path.realpath(run_dir), os.path.realpath(run_dir / ".checkpoint-1.partial")
    renamed = disk_syncs.index(("replace", partial, os.path.join(run, "checkpoint-1")))
    synced = [path for what, path, *_ in disk_syncs[:renamed] if what == "fsync"]
    names = {"optimizer.bin", "state_train.json", "state_train.safetensors", "manifest.json"}
    assert {p.name for p in final.iterdir()} == names
    files = {os.path.join(partial, name) for name in names}
    assert files <= set(synced), f"not flushed before the rename: {files - set(synced)}"
    assert max(synced.index(f) for f in files) < synced.index(partial), "the folder is flushed after its files"
    assert ("fsync", run) in disk_syncs[renamed:], "the rename itself is flushed (the run folder)"


def damage(path: Path) -> None:
    """Flip one byte in the middle of a file, as a bad disk or an interrupted copy would."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_latest_passes_over_a_damaged_checkpoint_naming_it(tmp_path: Path, caplog) -> None:
    run_dir = tmp_path / "ckpt" / "0123456789abcdef"
    m = manager(run_dir, total_limit=None)
    for step in (1, 2, 3):
        m.save(step)
    damage(run_dir / "checkpoint-3" / "optimizer.bin")
    with caplog.at_level(logging.WARNING, logger="tasks.train.checkpoints"):
        assert m.resolve("latest") == run_dir / "checkpoint-2"
    assert "checkpoint-3: optimizer.bin: changed since it was written (hash mismatch)" in caplog.text
    assert "resuming from checkpoint-2, the newest checkpoint that verifies" in caplog.text
    with pytest.raises(UserError, match=r"checkpoint-3 was altered .*optimizer.bin: changed since it was written"):
        m.resolve(str(run_dir / "checkpoint-3"))  # named explicitly: refused, never another one instead
    (run_dir / "checkpoint-2" / "manifest.json").unlink()
    (run_dir / "checkpoint-1" / "notes.txt").write_text("added")
    with pytest.raises(UserError, match=rf"no checkpoint in {re.escape(str(run_dir))} verifies.*checkpoint-3 was "
                                        r"altered.*checkpoint-2 has no manifest.json.*notes.txt: not a checkpoint "
                                        r"file.*Set train.resume: none to start over"):
        m.resolve("latest")


def test_an_abandoned_partial_save_goes_at_the_next_start_only_from_a_marked_run_folder(tmp_path: Path,
                                                                                      caplog) -> None:
    run_dir = tmp_path / "ckpt" / "0123456789abcdef"
    manager(run_dir).save(1)  # marks the run folder
    crashed = run_dir / ".checkpoint-7.partial"  # a save at step 7 the process never finished
    crashed.mkdir()
    (crashed / "optimizer.bin").write_bytes(b"half")
    (run_dir / ".notes.partial").mkdir()  # not a checkpoint save's name: kept
    with caplog.at_level(logging.INFO):
        manager(run_dir).remove_abandoned()
    assert not crashed.exists() and (run_dir / ".notes.partial").is_dir()
    assert [p.name for p in manager(run_dir).checkpoints()] == ["checkpoint-1"]
    assert re.search(r"removed \S*\.checkpoint-7\.partial: a checkpoint save that never finished", caplog.text)
    unmarked = tmp_path / "mine" / ".checkpoint-3.partial"
    unmarked.mkdir(parents=True)
    manager(unmarked.parent).remove_abandoned()
    assert unmarked.is_dir() and "not removing" in caplog.text and "carries no .sd-finetune-owned" in caplog.text


def test_train_refuses_an_output_folder_no_stage_wrote_before_it_trains(tmp_path: Path) -> None:
    """The output is written after the last step: a folder that cannot be replaced is refused at the start."""
    from tasks.train.core import train

    out = tmp_path / "finetuned"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    with pytest.raises(UserError, match=rf"refusing to replace {re.escape(str(out))}: it is a folder without .*"
                                        r"choose another --out"):
        train(TrainConfig(), tmp_path / "no-base", tmp_path / "no-data", None, out)  # neither is looked at
    assert (out / "mine.txt").read_text() == "keep me"
