"""Clips in: a `clips` source's video files and frame folders checked, sampled to ingest.video's frame
count and fps, bucketed by aspect and length, written as PNG frames per clip with a clips.jsonl row."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tasks.ingest.config import IngestConfig
from tasks.ingest.core import CLIPS_METADATA
from tests.conftest import REPO
from tests.ingest.clip_util import frame, make_clip
from tests.ingest.util import config, run

pytestmark = pytest.mark.quick


def clips_config(src: Path, **video: object) -> IngestConfig:
    return config([{"type": "clips", "path": str(src)}], video={"resolution": 64, **video})


def clip_rows(out: Path) -> dict[str, dict]:
    lines = (out / CLIPS_METADATA).read_text(encoding="utf-8").splitlines()
    return {row["path"]: row for row in map(json.loads, lines)}


def test_clip_files_and_frame_folders_are_sampled_to_the_frame_count_and_bucketed(tmp_path: Path) -> None:
    src = tmp_path / "clips"
    make_clip(src / "wave.mp4", frames=72, size=(96, 48))  # 3 s at 24 fps: 17 frames at 8 fps (25 needs 3 s + 1/8)
    (src / "wave.txt").write_text("a bar moves right", encoding="utf-8")
    make_clip(src / "sub" / "short.webm", frames=30, size=(64, 64))  # 1.2 s: 9 frames
    make_clip(src / "b.mov", frames=120, size=(48, 64))  # 5 s: 25 frames
    folder = src / "spin"
    folder.mkdir()
    for i in range(36):  # 1.5 s at frames_fps 24: 9 frames
        Image.fromarray(frame(i, (64, 64))).save(folder / f"{i:03d}.png")
    (src / "spin.txt").write_text("frames of a bar", encoding="utf-8")

    r = run(clips_config(src), tmp_path / "out")
    rows = clip_rows(r.out)
    assert r.rejected == [] and r.kept == []  # no image rows: clips have their own manifest
    assert {p: (row["frames"], row["bucket"]) for p, row in rows.items()} == {
        "wave.mp4": (17, "96x32x17"), "sub/short.webm": (9, "64x64x9"), "b.mov": (25, "64x64x25"),
        "spin": (9, "64x64x9")}
    wave = rows["wave.mp4"]
    assert (wave["text"], wave["caption_source"]) == ("a bar moves right", "file")
    assert (wave["source_frames"], wave["source_fps"], wave["codec"], wave["fps"]) == (72, 24.0, "h264", 8.0)
    assert rows["sub/short.webm"]["codec"] == "vp9" and rows["spin"]["text"] == "frames of a bar"
    files = sorted(p.name for p in (r.out / wave["file_name"]).iterdir())
    assert files == wave["frame_files"] == [f"{i:04d}.png" for i in range(17)]
    first, second = (np.asarray(Image.open(r.out / wave["file_name"] / f)) for f in files[:2])
    assert first.shape == (32, 96, 3) and np.abs(first.astype(int) - second).mean() > 1  # 1/8 s apart: moved
    assert r.summary.report()["clips"] == {
        "inputs": 4, "kept": 4, "by_bucket": {"64x64x25": 1, "64x64x9": 2, "96x32x17": 1}}
    assert not (r.out / ".clips-work").exists()


def test_samples_are_one_over_fps_apart(tmp_path: Path) -> None:
    """Frame i of the output is source frame 3i (24 fps sampled at 8 fps): the bar sits 12 px further each time."""
    src = tmp_path / "clips"
    folder = src / "bar"
    folder.mkdir(parents=True)
    for i in range(40):
        Image.fromarray(frame(i, (64, 64))).save(folder / f"{i:03d}.png")
    r = run(clips_config(src), tmp_path / "out")
    row = clip_rows(r.out)["bar"]
    bars = [int(np.argmax(np.asarray(Image.open(r.out / row["file_name"] / f))[0, :, 1])) for f in row["frame_files"]]
    assert bars == [12 * i % 64 for i in range(9)]  # the bar wraps at the 64 px edge


def test_a_too_short_clip_a_stray_file_and_an_orphan_caption_are_rejected_with_reasons(tmp_path: Path) -> None:
    src = tmp_path / "clips"
    make_clip(src / "ok.mp4", frames=30)
    make_clip(src / "blink.mp4", frames=6)  # 0.25 s: 9 frames at 8 fps need 1 s
    (src / "notes.md").write_text("x", encoding="utf-8")
    (src / "gone.txt").write_text("no clip", encoding="utf-8")
    Image.fromarray(frame(0, (64, 64))).save(src / "loose.png")
    r = run(clips_config(src), tmp_path / "out")
    assert r.reasons() == {"blink.mp4": "too_short", "notes.md": "unsupported_extension",
                           "gone.txt": "orphan_caption", "loose.png": "unsupported_extension"}
    assert "needs 1.00 s" in next(x["detail"] for x in r.rejected if x["path"] == "blink.mp4")
    assert list(clip_rows(r.out)) == ["ok.mp4"]


def test_the_same_clip_twice_is_a_duplicate(tmp_path: Path) -> None:
    src = tmp_path / "clips"
    make_clip(src / "a.mp4", frames=30)
    (src / "b.mp4").write_bytes((src / "a.mp4").read_bytes())
    r = run(clips_config(src), tmp_path / "out")
    assert r.reasons() == {"b.mp4": "duplicate"}
    assert len(list((r.out / "clips").iterdir())) == 1


def test_frame_counts_must_suit_the_video_vae() -> None:
    with pytest.raises(ValueError, match=r"frames \[16\] are not frame_step x k \+ 1.*use e.g. \[9\]"):
        IngestConfig.model_validate({"video": {"frames": [16]}})


def test_the_demo_clips_are_deterministic_and_ingest_keeps_three_and_rejects_the_broken_one(tmp_path: Path) -> None:
    """data/demo/clips.py (make data): a few KB per clip, the same bytes on every run; ingested as the README says."""
    script = REPO / "data" / "demo" / "clips.py"
    subprocess.run([sys.executable, str(script), "--out", str(tmp_path / "clips")], check=True, capture_output=True)
    spec = importlib.util.spec_from_file_location("demo_clips", script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    assert module.encode(module._frames("walk", 13), "mov") == (tmp_path / "clips" / "walk.mov").read_bytes()
    assert all((tmp_path / "clips" / n).stat().st_size < 8000 for n in ("wave.mp4", "nod.webm", "walk.mov"))
    r = run(config([{"type": "clips", "path": str(tmp_path / "clips")}]), tmp_path / "out")
    assert {p: row["bucket"] for p, row in clip_rows(r.out).items()} == {
        "nod.webm": "128x128x17", "walk.mov": "128x128x9", "wave.mp4": "128x128x17"}
    assert r.reasons() == {"broken.mp4": "corrupt"}
    assert r.rejected[0]["detail"] == "truncated: 1 of the 25 frames its header lists"


def test_no_usable_clip_is_an_error_naming_the_keys(tmp_path: Path) -> None:
    from tasks.common.errors import UserError
    from tasks.ingest.core import require_kept

    src = tmp_path / "clips"
    make_clip(src / "blink.mp4", frames=6)
    r = run(clips_config(src), tmp_path / "out")
    with pytest.raises(UserError, match=r"no usable images or clips \(1 inputs, rejected: \{'too_short': 1\}.*"
                                        r"ingest.video.frames at ingest.video.fps"):
        require_kept(r.summary)


def test_a_clip_file_s_samples_are_the_frames_nearest_each_step(tmp_path: Path) -> None:
    """24 fps sampled at 8 fps: sample k is source frame 3k, whose bar starts at 12k px (lossy H.264: +-2 px)."""
    src = tmp_path / "clips"
    make_clip(src / "bar.mp4", frames=40, size=(64, 64))
    r = run(clips_config(src), tmp_path / "out")
    row = clip_rows(r.out)["bar.mp4"]
    assert (row["width"], row["height"], row["frames"]) == (64, 64, 9)
    for k, name in enumerate(row["frame_files"]):
        green = np.asarray(Image.open(r.out / row["file_name"] / name))[:, :, 1].mean(axis=0) > 128
        columns = np.flatnonzero(green)
        assert abs(int(columns.min()) - 12 * k % 64) <= 2, (k, columns)


def test_clips_through_the_worker_pool_match_one_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tasks.ingest import core

    src = tmp_path / "clips"
    make_clip(src / "a.mp4", frames=30)
    make_clip(src / "b.webm", frames=48, size=(96, 48))
    os.mkfifo(src / "c.mov")
    one = run(clips_config(src), tmp_path / "one")
    monkeypatch.setattr(core, "POOL_MIN_ITEMS", 2)  # the pool path with a handful of inputs
    two = run(config([{"type": "clips", "path": str(src)}], workers=2, video={"resolution": 64}), tmp_path / "two")
    assert two.reasons() == one.reasons() == {"c.mov": "not_regular_file"}
    assert clip_rows(two.out) == clip_rows(one.out) and len(clip_rows(one.out)) == 2
    for row in clip_rows(one.out).values():
        for name in row["frame_files"]:
            assert (two.out / row["file_name"] / name).read_bytes() == (one.out / row["file_name"] / name).read_bytes()


def test_captions_from_metadata_jsonl_as_an_imagefolder_s(tmp_path: Path) -> None:
    src = tmp_path / "clips"
    make_clip(src / "a.mp4", frames=30)
    make_clip(src / "sub" / "b.mp4", frames=30, size=(64, 40))
    (src / "a.txt").write_text("the sidecar", encoding="utf-8")
    rows = [{"file_name": "a.mp4", "text": "from the metadata"}, {"file_name": "gone.mp4", "text": "x"}]
    (src / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    (src / "sub" / "metadata.jsonl").write_text(json.dumps({"file_name": "b.mp4", "text": "nested"}) + "\n",
                                                encoding="utf-8")
    r = run(clips_config(src), tmp_path / "out")
    got = {p: (row["text"], row["caption_source"]) for p, row in clip_rows(r.out).items()}
    assert got == {"a.mp4": ("from the metadata", "metadata"), "sub/b.mp4": ("nested", "metadata")}
    assert r.reasons() == {"gone.mp4": "missing_image"}
