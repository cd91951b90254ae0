"""Video training data: ingest's clips (`clips.jsonl`, one folder of frames per clip) as Records.

The ingest stage has already sampled each clip to a frame count the video VAE takes (8k+1 for
LTX-Video) and cut its frames to the clip's bucket (tasks/ingest/README.md, "Video clips"), so a clip
trains at its own size and length: no resize or crop here, only the flip. A batch holds clips of one
bucket (size and frame count; `TrainDataset.batch_groups`). A clip's latent key is the SHA-256 of
its frames' digests in order, with its size and flip, so the latent caches (memory or disk) hold clips
like images.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from tasks.common.errors import UserError

CLIPS_METADATA = "clips.jsonl"  # what ingest writes (tasks/ingest/core.py's CLIPS_METADATA)


def read_clips(folder: Path, what: str, fix: str, caption_column: str, record: Callable[..., Any]) -> list[Any]:
    """The rows of `folder/clips.jsonl` as `record(...)` (data.Record), each clip's frames checked on disk;
    a UserError naming the file, the line and `fix` where a row is bad or there is none."""
    meta = Path(folder) / CLIPS_METADATA
    if not meta.is_file():
        raise UserError(f"{what}: {meta} not found: a video model trains on clips. {fix} (a `clips` source: "
                        "tasks/ingest/README.md, \"Video clips\")")
    records = []
    for line_no, line in enumerate(meta.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{what}: {meta}:{line_no}"
        try:
            row = json.loads(line)
            clip = Path(folder) / row["file_name"]
            frames = tuple(clip / name for name in row["frame_files"])
            size = (int(row["height"]), int(row["width"]))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
            raise UserError(f"{where} is not a clip row (file_name, frame_files, height, width: {err}). "
                            f"{fix}") from None
        if missing := [f.name for f in frames if not f.is_file()]:
            raise UserError(f"{where}: clip {row['file_name']} lacks the frame(s) {', '.join(missing[:3])}. {fix}")
        if caption_column != "text" and caption_column not in row:
            raise UserError(f"{where} has no column {caption_column!r} (train.caption_column); columns: "
                            f"{', '.join(sorted(row))}")
        records.append(record(clip, str(row.get(caption_column) or ""), size=size, concept=row.get("concept"),
                              repeats=row["repeats"] if isinstance(row.get("repeats"), int) and row["repeats"] >= 1
                              else 1, frames=frames))
    if not records:
        raise UserError(f"{what}: {meta} lists no clips. {fix}")
    return records


def clip_digest(frames: tuple[Path, ...], digest: Callable[[Path], str] | None = None) -> str:
    """The SHA-256 of a clip's frame digests in order (`digest`: a file's SHA-256, memoised by the disk store)."""
    digest = digest or (lambda path: hashlib.sha256(path.read_bytes()).hexdigest())
    return hashlib.sha256("".join(digest(f) for f in frames).encode()).hexdigest()


def clip_pixels(frames: tuple[Path, ...], size: tuple[int, int], flip: bool) -> torch.Tensor:
    """A clip's frames as (3, F, H, W) in [-1, 1], flipped left-right when `flip`; a frame not of the
    clip's size (an edited folder) is a UserError."""
    arrays = []
    for path in frames:
        with Image.open(path) as im:
            if (im.height, im.width) != size:
                raise UserError(f"clip frame {path} is {im.width}x{im.height}, its clips.jsonl row says "
                                f"{size[1]}x{size[0]}; run the ingest stage again (dvc repro ingest)")
            arrays.append(np.asarray(im.convert("RGB"), dtype=np.float32))
    video = torch.from_numpy((np.stack(arrays) / 127.5 - 1.0).astype(np.float32)).permute(3, 0, 1, 2).contiguous()
    return video.flip(-1) if flip else video
