"""Where records come from: today a folder of images with sidecar caption files.

A source turns a dataset root into a sorted list of `Entry`s: one per input file, so that every
file is accounted for (kept or rejected) downstream. Entries that can be judged from their name
alone (wrong extension, orphan caption, directory link leaving the root) carry their rejection;
image entries carry the path of their caption file, read later through the same root-confined
reader as the image. Other source types (JSON metadata, imagefolder, hub; issue 3) are further
functions returning the same `Entry` list.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from tasks.ingest.checks import Reject, read_bytes

log = logging.getLogger(__name__)

#: Extensions treated as images (case-insensitive). Anything else is rejected by name.
IMAGE_EXTENSIONS = frozenset({".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff"})
CAPTION_EXTENSION = ".txt"


@dataclass(frozen=True)
class Entry:
    """One input file of a source."""

    rel: str  # path relative to the source root, POSIX style: what reports name
    path: Path  # the path as listed under the root (not resolved: checks resolve it safely)
    caption_path: Path | None = None  # sidecar caption, when one exists
    reject: Reject | None = field(default=None, compare=False)  # decided from the name alone


def scan_folder(root: Path, caption_ext: str = CAPTION_EXTENSION) -> list[Entry]:
    """List every file under `root` (any depth), sorted by relative path.

    Caption files next to an image are consumed by that image and not listed on their own.
    Directory symlinks are not followed: one pointing outside the root is listed as rejected,
    one pointing inside is skipped (its files are listed at their real location).
    """
    root = root.resolve()
    entries: list[Entry] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        here = Path(dirpath)
        dirnames.sort()
        for d in list(dirnames):
            link = here / d
            if link.is_symlink():
                target = link.resolve()
                if target != root and root not in target.parents:
                    rel = link.relative_to(root).as_posix()
                    reject = Reject("symlink_outside_root", f"directory link to {target}")
                    entries.append(Entry(rel, link, reject=reject))
                else:
                    log.debug("not following directory link %s (inside the root)", link)
        names = set(filenames)
        consumed: set[str] = set()
        for name in names:
            if Path(name).suffix.lower() in IMAGE_EXTENSIONS:
                caption = Path(name).stem + caption_ext
                if caption in names:
                    consumed.add(caption)
                path = here / name
                caption_path = here / caption if caption in names else None
                entries.append(Entry(path.relative_to(root).as_posix(), path, caption_path))
        for name in names - consumed:
            path = here / name
            suffix = Path(name).suffix.lower()
            if suffix in IMAGE_EXTENSIONS:
                continue
            if suffix == caption_ext.lower():
                reject = Reject("orphan_caption", "no image with this stem beside it")
            else:
                what = suffix or "no extension"
                reject = Reject("unsupported_extension", f"{what} is not an image type")
            entries.append(Entry(path.relative_to(root).as_posix(), path, reject=reject))
    entries.sort(key=lambda e: e.rel)
    return entries


def read_caption(root: Path, entry: Entry) -> str | None:
    """The entry's caption text (whitespace collapsed), or None when absent or empty.

    Read through the root-confined reader: a caption linking outside the root rejects the image.
    """
    if entry.caption_path is None:
        return None
    try:
        data = read_bytes(root.resolve(), entry.caption_path)
    except Reject as err:
        if err.reason == "empty_file":
            return None
        raise Reject(err.reason, f"caption {entry.caption_path.name}: {err.detail}") from None
    text = " ".join(data.decode("utf-8-sig", errors="replace").split())
    return text or None
