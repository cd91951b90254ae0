"""Hostile inputs cannot hang or swamp ingest: only regular files are read, text files have byte caps,
kohya repeats have the train stage's cap, and a mask is sized from its header before it is decoded.

A FIFO opened for reading blocks until a writer comes: each run that meets one goes through `bounded`,
which fails the test (and frees the reader) instead of hanging the session.
"""
from __future__ import annotations

import io
import json
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
from PIL import Image, ImageFile

from tasks.common.errors import UserError
from tasks.ingest.checks import (
    CAPTION_MAX_BYTES,
    METADATA_JSON_MAX_BYTES,
    METADATA_MAX_BYTES,
    Reject,
    read_regular,
)
from tasks.ingest.config import MAX_REPEATS
from tasks.ingest.masks import read_mask
from tests.ingest.util import bomb_png, config, picture, run, run_folder, save

pytestmark = pytest.mark.quick

T = TypeVar("T")


def bounded(call: Callable[[], T], fifos: list[Path], seconds: float = 30) -> T:
    """`call()` in a thread; if it is still running after `seconds`, it is stuck reading a FIFO:
    open each FIFO's writing end (which lets the reader see end-of-file) and fail."""
    box: dict[str, object] = {}

    def target() -> None:
        try:
            box["value"] = call()
        except BaseException as err:  # re-raised in the test's thread
            box["error"] = err

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        for fifo in fifos:
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        thread.join(5)
        pytest.fail(f"still running after {seconds}s: a FIFO among {[f.name for f in fifos]} was opened to read")
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


@pytest.mark.timeout(120)
def test_fifos_and_sockets_are_rejected_unopened(tmp_path: Path) -> None:
    src = tmp_path / "src"
    save(src / "ok.png", picture(1))
    src.joinpath("sub").mkdir()
    fifos = [src / "a.png", src / "sub" / "b.jpg", src / "c.txt", src / "d-masklabel.png"]
    for fifo in fifos:
        os.mkfifo(fifo)
    save(src / "c.png", picture(2))  # its caption c.txt is a FIFO
    save(src / "d.png", picture(3))  # its mask d-masklabel.png is a FIFO
    (src / "link.png").symlink_to(src / "a.png")  # a link to a FIFO inside the root
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(src / "e.png"))
        r = bounded(lambda: run_folder(src, tmp_path / "out", workers=2), fifos)
    assert r.reasons() == {"a.png": "not_regular_file", "sub/b.jpg": "not_regular_file",
                           "link.png": "not_regular_file", "e.png": "not_regular_file",
                           "c.png": "not_regular_file", "d.png": "bad_mask"}
    details = {row["path"]: row["detail"] for row in r.rejected}
    assert "a FIFO" in details["a.png"] and "never opened" in details["a.png"]
    assert "a socket" in details["e.png"]
    assert details["c.png"].startswith("caption c.txt: a FIFO")
    assert "mask d-masklabel.png" in details["d.png"] and "a FIFO" in details["d.png"]
    assert [row["path"] for row in r.kept] == ["ok.png"]
    assert r.summary.report()["rejected_by_reason"]["not_regular_file"] == 5


@pytest.mark.timeout(60)
def test_read_regular_never_opens_a_fifo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    opened: list[object] = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda path, *a, **kw: opened.append(path) or real_open(path, *a, **kw))
    with pytest.raises(Reject) as err:
        bounded(lambda: read_regular(fifo), [fifo])
    assert err.value.reason == "not_regular_file" and opened == []
    with pytest.raises(Reject, match="not_regular_file: a folder"):
        read_regular(tmp_path)


@pytest.mark.timeout(120)
def test_a_fifo_as_metadata_is_refused_unopened(tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    save(hf / "x.png", picture(1))
    os.mkfifo(hf / "metadata.jsonl")
    with pytest.raises(UserError, match=r"metadata file metadata.jsonl: not_regular_file: a FIFO"):
        bounded(lambda: run(config([{"type": "imagefolder", "path": str(hf)}]), tmp_path / "out"),
                [hf / "metadata.jsonl"])
    booru = tmp_path / "booru"
    save(booru / "images" / "0.png", picture(2))
    (booru / "metadata").mkdir()
    os.mkfifo(booru / "metadata" / "0.json")
    r = bounded(lambda: run(config([{"type": "metadata_json", "path": str(booru)}]), tmp_path / "out2"),
                [booru / "metadata" / "0.json"])
    assert r.reasons() == {"metadata/0.json": "not_regular_file"}


def _sparse(path: Path, size: int) -> Path:
    """A file of `size` bytes that takes no disk space (and, unread, no memory)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        fh.truncate(size)
    return path


def test_captions_over_the_cap_are_rejected_naming_file_size_and_cap(tmp_path: Path) -> None:
    src = tmp_path / "src"
    save(src / "big.png", picture(1))
    (src / "big.txt").write_text("word " * (CAPTION_MAX_BYTES // 5) + "extra")  # the cap plus 4 bytes
    save(src / "at_cap.png", picture(2))
    (src / "at_cap.txt").write_text("x" * (CAPTION_MAX_BYTES - 2) + " y")  # exactly the cap: read
    r = run_folder(src, tmp_path / "out")
    assert r.reasons() == {"big.png": "oversized_file"}
    detail = r.rejected[0]["detail"]
    assert detail == (f"caption big.txt: {CAPTION_MAX_BYTES + 4:,} bytes, over the cap of 64 KiB for this kind "
                      "of file; shorten it (or split it)")
    assert [row["path"] for row in r.kept] == ["at_cap.png"]


def test_metadata_files_over_the_cap_are_refused_unread(tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    save(hf / "x.png", picture(1))
    _sparse(hf / "metadata.jsonl", METADATA_MAX_BYTES + 1)
    with pytest.raises(UserError, match=rf"metadata file metadata.jsonl: oversized_file: "
                                        rf"{METADATA_MAX_BYTES + 1:,} bytes, over the cap of 256 MiB"):
        run(config([{"type": "imagefolder", "path": str(hf)}]), tmp_path / "out")
    booru = tmp_path / "booru"
    save(booru / "images" / "0.png", picture(2))
    save(booru / "images" / "1.png", picture(3))
    _sparse(booru / "metadata" / "0.json", METADATA_JSON_MAX_BYTES + 1)
    (booru / "metadata" / "1.json").write_text(json.dumps({"tags": ["a"], "path": "images/1.png"}))
    r = run(config([{"type": "metadata_json", "path": str(booru)}]), tmp_path / "out2")
    assert r.reasons() == {"metadata/0.json": "oversized_file"}
    assert "over the cap of 1 MiB" in r.rejected[0]["detail"]
    assert [row["metadata_file"] for row in r.kept] == ["metadata/1.json"]


def test_kohya_repeats_over_the_cap_are_refused_naming_folder_and_cap(tmp_path: Path) -> None:
    root = tmp_path / "train"
    save(root / f"{MAX_REPEATS}_sks dog" / "a.png", picture(1))
    r = run(config([{"type": "folder", "path": str(root), "kohya_folders": True}]), tmp_path / "out")
    assert [row["repeats"] for row in r.kept] == [MAX_REPEATS]  # the cap itself is fine
    save(root / "999999999_ohwx cat" / "b.png", picture(2))
    with pytest.raises(UserError, match=rf"'999999999_ohwx cat' .* 999999999 repeats is over the cap of "
                                        rf"{MAX_REPEATS} .*`{MAX_REPEATS}_ohwx cat`"):
        run(config([{"type": "folder", "path": str(root), "kohya_folders": True}]), tmp_path / "out2")
    with pytest.raises(ValueError, match=rf"less than or equal to {MAX_REPEATS}"):
        config([{"type": "folder", "path": str(root), "repeats": MAX_REPEATS + 1}])


def test_the_repeats_cap_is_the_train_stages() -> None:
    from tasks.train.concepts import ConceptConfig

    caps = [getattr(m, "le", None) for m in ConceptConfig.model_fields["repeats"].metadata]
    assert MAX_REPEATS in caps, "ingest and train.concepts cap repeats alike"


def test_a_mask_is_sized_from_its_header_before_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_decoding(self: ImageFile.ImageFile) -> None:
        raise AssertionError("the mask's pixels were decoded")

    wrong = io.BytesIO()
    Image.new("L", (48, 48), 255).save(wrong, format="PNG")
    big = io.BytesIO()
    Image.new("L", (3000, 2000), 255).save(big, format="PNG")
    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decoding)
    with pytest.raises(Reject, match="mask m.png is 48x48, its image 96x96") as err:
        read_mask(wrong.getvalue(), "m.png", (96, 96), (96, 96), max_pixels=4_000_000)
    assert err.value.reason == "bad_mask"
    with pytest.raises(Reject, match="mask m.png is too large .*6000000 pixels.* 4000000") as err:
        read_mask(big.getvalue(), "m.png", (96, 96), (96, 96), max_pixels=4_000_000)
    assert err.value.reason == "bad_mask"


def test_a_decompression_bomb_mask_is_bad_mask_not_corrupt(tmp_path: Path) -> None:
    src = tmp_path / "src"
    save(src / "a.png", picture(1))
    (src / "a-masklabel.png").write_bytes(bomb_png(14_000, 13_000))  # 182 million pixels, 22 KB
    r = run_folder(src, tmp_path / "out")  # the default max_pixels: PIL's own bomb limit
    assert r.reasons() == {"a.png": "bad_mask"}
    detail = r.rejected[0]["detail"]
    assert "mask a-masklabel.png is too large" in detail and "decompression bomb" in detail
