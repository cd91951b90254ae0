"""Hostile clips cannot hang or swamp ingest: a truncated file, a header claiming ten hours, a clip with no
frame, a FIFO named like a video, an oversized file, each rejected with its reason in bounded time; a clip
whose decoding passes decode_seconds is killed with its confined child."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.ingest.clip_util import hours_long_header, make_clip, truncated, zero_frames
from tests.ingest.test_bounded import bounded
from tests.ingest.test_clips import clip_rows, clips_config
from tests.ingest.util import run

pytestmark = pytest.mark.quick

#: Seconds the whole hostile set may take: each clip costs one confined child (about 0.3 s to start here)
BOUND_S = 20


@pytest.mark.timeout(120)
def test_hostile_clips_are_rejected_with_reasons_in_bounded_time(tmp_path: Path) -> None:
    src = tmp_path / "clips"
    make_clip(src / "good.mp4", frames=30)
    truncated(src / "cut.mp4")
    hours_long_header(src / "ten_hours.mp4")
    zero_frames(src / "empty_track.mp4")
    (src / "zero_bytes.webm").write_bytes(b"")
    (src / "noise.mov").write_bytes(os.urandom(4096))
    make_clip(src / "big.mp4", frames=96, size=(256, 192))  # over max_bytes below: never opened
    os.mkfifo(src / "x.mp4")  # opened for reading, it would block until a writer comes
    max_bytes = (src / "big.mp4").stat().st_size - 1
    assert (src / "good.mp4").stat().st_size <= max_bytes

    start = time.monotonic()
    r = bounded(lambda: run(clips_config(src, max_bytes=max_bytes), tmp_path / "out"), [src / "x.mp4"])
    elapsed = time.monotonic() - start

    assert elapsed < BOUND_S, f"{elapsed:.1f} s"
    assert r.reasons() == {
        "cut.mp4": "corrupt", "ten_hours.mp4": "too_long", "empty_track.mp4": "too_short",
        "zero_bytes.webm": "empty_file", "noise.mov": "corrupt", "big.mp4": "oversized_file",
        "x.mp4": "not_regular_file"}
    detail = {x["path"]: x["detail"] for x in r.rejected}
    assert detail["cut.mp4"].startswith("truncated: ") and "of the 48 frames its header lists" in detail["cut.mp4"]
    assert detail["ten_hours.mp4"] == "its header states 36,000.0 s > ingest.video.max_seconds 60"
    assert detail["empty_track.mp4"] == "0 frames: the file holds no video packet"
    assert detail["x.mp4"].startswith("a FIFO (named pipe), not a regular file: never opened")
    assert list(clip_rows(r.out)) == ["good.mp4"]


@pytest.mark.timeout(60)
def test_a_clip_over_decode_seconds_is_killed_and_rejected(tmp_path: Path) -> None:
    src = tmp_path / "clips"
    make_clip(src / "slow.mp4", frames=30)
    start = time.monotonic()
    r = run(clips_config(src, decode_seconds=0.05), tmp_path / "out")  # the child cannot even start in time
    assert time.monotonic() - start < 5
    assert r.reasons() == {"slow.mp4": "decode_limit"}
    assert "ingest.video.decode_seconds 0.05 s: killed" in r.rejected[0]["detail"]
    assert not (r.out / "clips").exists() and not (r.out / ".clips-work").exists()


@pytest.mark.timeout(60)
def test_a_clip_over_the_length_or_frame_size_is_refused_from_its_header(tmp_path: Path) -> None:
    src = tmp_path / "clips"
    make_clip(src / "long.mp4", frames=72)  # 3 s
    make_clip(src / "wide.mp4", frames=30, size=(128, 96))
    r = run(clips_config(src, max_seconds=2, max_pixels=100 * 100), tmp_path / "out")
    assert r.reasons() == {"long.mp4": "too_long", "wide.mp4": "too_large"}
    detail = {x["path"]: x["detail"] for x in r.rejected}
    assert detail["long.mp4"] == "its header states 3.0 s > ingest.video.max_seconds 2"
    assert detail["wide.mp4"] == "128x96 = 12288 pixels per frame > ingest.video.max_pixels 10000"


@pytest.mark.timeout(60)
def test_a_clip_needing_more_than_decode_memory_mb_is_rejected_not_swapped_in(tmp_path: Path) -> None:
    """The child caps its address space before FFmpeg loads: a 4K clip needs more than 256 MiB."""
    src = tmp_path / "clips"
    make_clip(src / "huge.mp4", frames=9, size=(3840, 2160), fps=8)  # decoding a 4K frame: about 320 MiB here
    make_clip(src / "small.mp4", frames=9, fps=8)  # the child's baseline: about 180 MiB
    r = run(clips_config(src, decode_memory_mb=256), tmp_path / "out")
    assert r.reasons() == {"huge.mp4": "decode_limit"} and list(clip_rows(r.out)) == ["small.mp4"]
    assert "ingest.video.decode_memory_mb 256 MiB" in r.rejected[0]["detail"]
