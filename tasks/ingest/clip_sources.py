"""The `clips` source: video files and folders of frames at any depth, each one input (one `Item`).

```
data/demo/clips/            ingest.sources: [{type: clips}]
  wave.mp4   wave.txt       a clip file (mp4, webm, mov) and its caption beside it
  spin/      spin.txt       a folder of frames (name order, shot at the source's frames_fps) and its
    0000.png 0001.png ...   caption beside the folder
  metadata.jsonl            or captions as an imagefolder's: {"file_name": "wave.mp4", "text": "..."}
```

A clip's caption: `instance_prompt`, else its metadata row's `caption_column`, else its sidecar.

Anything else is accounted for as an image source's would be: a caption without its clip is
`orphan_caption`, an image directly in the root (not in a clip's folder) or another file
`unsupported_extension`. Folders are walked as for images (tasks/ingest/sources.py: sorted, links
leaving the root rejected); a sub-folder of a frame folder is a clip of its own.
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from tasks.ingest.checks import Reject
from tasks.ingest.config import ClipsSource
from tasks.ingest.sources import IMAGE_EXTENSIONS, IMAGEFOLDER_METADATA, Item, read_metadata_captions, source_root, walk
from tasks.ingest.work import Task

#: Clip file extensions (case-insensitive); FFmpeg reads each (MP4 and MOV: the mov demuxer; WebM: matroska).
VIDEO_EXTENSIONS = frozenset({".mp4", ".webm", ".mov"})


def is_video(name: str) -> bool:
    return Path(name).suffix.lower() in VIDEO_EXTENSIONS


def iter_clips(src: ClipsSource, label: str, key: str) -> Iterator[Item]:
    """Every clip file and frame folder under the source's root, in walk order."""
    root = source_root(src.path, f"{key}.path")
    listed, problems = read_metadata_captions(root, src.caption_column, label, key) if src.instance_prompt is None \
        else ({}, [])
    yield from problems
    for here, names, rejected in walk(root, label):
        yield from rejected
        names = [n for n in names if n not in IMAGEFOLDER_METADATA]
        images = [n for n in names if Path(n).suffix.lower() in IMAGE_EXTENSIONS]
        frame_folder = here != root and images
        if frame_folder:
            yield _item(src, root, here, label, _sidecar(here.parent, here.name, src), tuple(images), listed)
        subfolders = {p.name for p in here.iterdir() if p.is_dir() and not p.is_symlink()} if names else set()
        captions = {c.name for n in names if is_video(n) and (c := _sidecar(here, Path(n).stem, src))}
        for name in names:
            if is_video(name):
                yield _item(src, root, here / name, label, _sidecar(here, Path(name).stem, src), (), listed)
            elif name not in captions and (reject := _not_a_clip(src, name, subfolders, bool(frame_folder))):
                yield Item.rejected(label, (here / name).relative_to(root).as_posix(), reject)
    for rel in sorted(listed):  # metadata rows naming no clip on disk
        reject = Reject("missing_image", "listed in the metadata, no clip or frame folder there")
        yield Item.rejected(label, rel, reject)


def _not_a_clip(src: ClipsSource, name: str, subfolders: set[str], frame_folder: bool) -> Reject | None:
    """Why a file that is not a clip is rejected; None for a folder's caption or a frame of a frame folder."""
    suffix = Path(name).suffix.lower()
    if suffix in src.caption_extensions:
        if Path(name).stem in subfolders:
            return None  # a frame folder's caption, read with its folder
        return Reject("orphan_caption", "no clip or folder of frames with this stem")
    if suffix in IMAGE_EXTENSIONS:
        return None if frame_folder else Reject(
            "unsupported_extension", "an image beside the clips: put a clip's frames in a folder of their own "
            "(one folder per clip)")
    return Reject("unsupported_extension",
                  f"{suffix or 'no extension'} is not a clip type ({', '.join(sorted(VIDEO_EXTENSIONS))})")


def _sidecar(folder: Path, stem: str, src: ClipsSource) -> Path | None:
    """The caption file `<stem><ext>` in `folder` (first of caption_extensions), or None."""
    found = (folder / (stem + e) for e in src.caption_extensions)
    return next((p for p in found if os.path.lexists(p)), None)  # a FIFO or a link too: read_caption refuses it


def _item(src: ClipsSource, root: Path, path: Path, label: str, caption: Path | None,
          frames: tuple[str, ...], listed: dict[str, str | None]) -> Item:
    """A clip's item: its caption from instance_prompt, else its metadata row's, else its sidecar."""
    rel = path.relative_to(root).as_posix()
    in_metadata = rel in listed
    text = listed.pop(rel, None)
    task = Task(root=str(root), path=str(path), clip=True, frames=tuple(str(path / f) for f in frames),
                frames_fps=src.frames_fps,
                caption_path=str(caption) if caption is not None and src.instance_prompt is None else None)
    if src.instance_prompt is not None:
        return Item(label, rel, task, src.instance_prompt, "instance_prompt")
    if in_metadata and text is not None:
        return Item(label, rel, replace(task, caption_path=None), text, "metadata")
    return Item(label, rel, task, caption_source="file" if caption else "none")
