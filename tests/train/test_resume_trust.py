"""Resume without trust: a checkpoint folder is read only if this stage wrote it for this run, and a
crafted pickle in it never runs, even behind a forged manifest; `latest` passes over a damaged one."""
from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest

from tasks.common.errors import UserError
from tasks.common.fingerprint import sha256_file
from tasks.train import checkpoint_files
from tasks.train.config import TrainConfig
from tasks.train.core import train


class Payload:
    """Unpickling this creates `marker`: what a hostile checkpoint would do (run code)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


def crafted(marker: Path) -> bytes:
    return pickle.dumps(Payload(marker))


def config(tmp_path: Path, **kw) -> TrainConfig:
    return TrainConfig(**{"max_train_steps": 2, "train_batch_size": 1, "resolution": 32, "num_validation_images": 0,
                          "with_prior_preservation": False, "checkpointing_steps": 1, "checkpoints_total_limit": 1,
                          "checkpoints_dir": tmp_path / "ckpt", "resume": "none", **kw})


@pytest.fixture(scope="module")
def written(tmp_path_factory, tiny_sd, instance_dir) -> Path:
    """A run's folder with its checkpoint-2, as the stage wrote it."""
    root = tmp_path_factory.mktemp("trust")
    outcome = train(config(root), tiny_sd, instance_dir, None, root / "out")
    return outcome.checkpoint_dir / "checkpoint-2"


@pytest.fixture
def checkpoint(written, tmp_path) -> Path:
    """A fresh copy of the run folder under this test's checkpoints_dir (same run key)."""
    run_dir = tmp_path / "ckpt" / written.parent.name
    shutil.copytree(written.parent, run_dir)
    return run_dir / written.name


def forge_manifest(folder: Path) -> None:
    """What an attacker who knows the format would do: list every file with its real hash."""
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"] = {p.name: sha256_file(p) for p in folder.iterdir() if p.name != "manifest.json"}
    (folder / "manifest.json").write_text(json.dumps(manifest))


def test_the_payload_is_live(tmp_path) -> None:
    """Control: unpickled the usual way, the crafted file does run code."""
    marker = tmp_path / "ran"
    pickle.loads(crafted(marker))
    assert marker.exists()


def test_a_checkpoint_holds_only_safetensors_json_and_accelerates_tensor_files(written) -> None:
    names = {p.name for p in written.iterdir()}
    assert {"manifest.json", "trainable_unet.safetensors", "state_train.safetensors", "state_train.json",
            "optimizer.bin", "scheduler.bin", "random_states_0.pkl"} == names
    manifest = json.loads((written / "manifest.json").read_text())
    assert manifest["run_key"] == written.parent.name and manifest["step"] == 2
    assert manifest["files"]["trainable_unet.safetensors"] == sha256_file(written / "trainable_unet.safetensors")


CASES = {
    # name: (what is done to the checkpoint, forge the manifest, the error)
    "extra pickle": ("evil.pkl", False, r"evil.pkl: not a checkpoint file; evil.pkl: not in the manifest"),
    "accelerate's old custom state": ("custom_checkpoint_0.pkl", True,
                                      r"custom_checkpoint_0.pkl: not a checkpoint file"),
    "swapped optimizer": ("optimizer.bin", False, r"optimizer.bin: changed since it was written"),
    "swapped optimizer, forged manifest": ("optimizer.bin", True, r"refused to resume.*holds more than tensors"),
    "swapped scheduler, forged manifest": ("scheduler.bin", True, r"refused to resume.*holds more than tensors"),
    "swapped RNG states, forged manifest": ("random_states_0.pkl", True, r"refused to resume.*holds more than tensors"),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("resume", ["latest", "explicit"])
def test_a_crafted_pickle_never_runs(case, resume, checkpoint, tmp_path, tiny_sd, instance_dir) -> None:
    name, forge, error = CASES[case]
    marker = tmp_path / "ran"
    (checkpoint / name).write_bytes(crafted(marker))
    if forge:
        forge_manifest(checkpoint)
    cfg = config(tmp_path, resume="latest" if resume == "latest" else str(checkpoint))
    with pytest.raises(UserError, match=error):
        train(cfg, tiny_sd, instance_dir, None, tmp_path / "out")
    assert not marker.exists(), "the crafted pickle ran"
    assert not (tmp_path / "out").exists(), "a refused resume writes no output"


def test_a_folder_without_a_manifest_is_refused(checkpoint, tmp_path, tiny_sd, instance_dir) -> None:
    (checkpoint / "manifest.json").unlink()
    with pytest.raises(UserError, match=r"checkpoint-2 has no manifest.json.*not trusted.*train.resume: none"):
        train(config(tmp_path, resume="latest"), tiny_sd, instance_dir, None, tmp_path / "out")


def test_another_runs_checkpoint_is_refused(checkpoint, tmp_path, tiny_sd, instance_dir) -> None:
    """Same stage, other settings: another run key, so its checkpoint is not this run's to continue."""
    other = config(tmp_path, resume=str(checkpoint), learning_rate=5e-5)
    with pytest.raises(UserError, match=rf"belongs to run {checkpoint.parent.name}, not to this run"):
        train(other, tiny_sd, instance_dir, None, tmp_path / "out")


def test_an_intact_checkpoint_resumes(checkpoint, tmp_path, tiny_sd, instance_dir) -> None:
    outcome = train(config(tmp_path, resume="latest", max_train_steps=3), tiny_sd, instance_dir, None, tmp_path / "out")
    assert outcome.resumed_from == 2 and [h.step for h in outcome.history] == [3]


def test_latest_resumes_from_the_newest_checkpoint_that_verifies(tmp_path, tiny_sd, instance_dir, caplog) -> None:
    """A checkpoint whose weights file lost a byte (a bad disk, a copy cut short) is passed over, named in
    the log; the run continues from the one before, exactly, and rewrites the damaged step; a `.partial`
    folder a crash left mid-save goes at the start."""
    first = train(config(tmp_path, max_train_steps=3, checkpoints_total_limit=3), tiny_sd, instance_dir, None,
                  tmp_path / "out")
    run_dir = first.checkpoint_dir
    damaged = run_dir / "checkpoint-3" / "trainable_unet.safetensors"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    (run_dir / ".checkpoint-9.partial").mkdir()
    (run_dir / ".checkpoint-9.partial" / "optimizer.bin").write_bytes(b"cut short")
    cfg = config(tmp_path, resume="latest", max_train_steps=4, checkpoints_total_limit=3)
    with caplog.at_level("INFO"):
        outcome = train(cfg, tiny_sd, instance_dir, None, tmp_path / "out")
    assert outcome.resumed_from == 2 and [h.step for h in outcome.history] == [3, 4]
    assert "checkpoint-3: trainable_unet.safetensors: changed since it was written (hash mismatch)" in caplog.text
    assert ".checkpoint-9.partial: a checkpoint save that never finished" in caplog.text
    assert not (run_dir / ".checkpoint-9.partial").exists()
    assert [p[1] for p in outcome.losses[:3]] == pytest.approx([p[1] for p in first.losses], rel=1e-6)
    checkpoint_files.verify(run_dir / "checkpoint-3", run_dir.name)  # step 3 written again, whole
