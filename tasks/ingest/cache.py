"""Content-addressed store of processed images, so a re-run processes only what is new.

Layout: `<cache_dir>/<fingerprint>/<sha[:2]>/<sha>.json` (the outcome: kept image facts or a
rejection), `<sha>.<png|jpg>` (the processed image), `<sha>.mask.png` (its processed mask,
if it has one) and `<sha>.ref<i>.png` (its processed reference images, if any). `sha` is the
SHA-256 of the source file's bytes, or, for an image with a mask file or references, of all the
files' hashes (a changed mask is a new entry, never a stale one); `fingerprint`
hashes every parameter that changes the processed pixels and the
source code that produces them, so a changed parameter or a code change never reuses stale
results (it starts a new fingerprint directory; only the most recent ones are kept).

Only the cache's own folders are ever pruned: each parameter set carries the project's marker
(tasks/common/safe_remove.py), and anything else under `cache_dir` (another stage's checkpoints
when `cache_dir` is `.cache`, a user's files) is left alone. A set written before the marker
existed is recognised by its layout (a 16-hex-digit name holding `.last_used` and only
two-hex-digit folders) and pruned like a marked one; it is marked when a run uses it again.

Where it lives: outside the stage's outs (default `.cache/ingest` at the repository root). DVC
deletes an out before it reruns a stage, so a cache inside `data/processed` would be gone on
every run; `.cache/` is ignored by git and by DVC (.gitignore, .dvcignore). Deleting it is always
safe: the next run is a cold one and writes the same outputs.

Without a cache directory the same store runs in a temporary folder inside the output being
built, and kept images are moved (not copied) out of it.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import PIL

from tasks.common import safe_remove

log = logging.getLogger(__name__)

#: Source files whose code decides the processed pixels: part of the fingerprint.
_CODE = ("tasks/ingest/checks.py", "tasks/ingest/work.py", "tasks/ingest/masks.py", "tasks/ingest/references.py",
         "tasks/common/images.py")
KEEP_FINGERPRINTS = 3  # parameter sets kept on disk (switching back and forth stays warm)
USED = ".last_used"
KIND = "ingest-cache"  # the marker's kind on each parameter set (and on a one-run staging folder)
_HEX = frozenset("0123456789abcdef")


def fingerprint(settings: dict[str, Any]) -> str:
    """16 hex digits over the pixel-affecting settings, the processing code and PIL's version."""
    repo = Path(__file__).resolve().parents[2]
    digest = hashlib.sha256()
    digest.update(json.dumps(settings, sort_keys=True, default=str).encode())
    digest.update(PIL.__version__.encode())
    for rel in _CODE:
        digest.update((repo / rel).read_bytes())
    return digest.hexdigest()[:16]


class Store:
    """Processed results by content hash; safe for several processes writing at once."""

    def __init__(self, root: Path, persistent: bool) -> None:
        self.root = Path(root)
        self.persistent = persistent

    def _base(self, sha: str) -> Path:
        # A persistent cache fans out over 256 folders; a one-run staging folder stays flat
        # (one folder to delete at the end: removing folders is slow on some file systems).
        return self.root / sha[:2] / sha if self.persistent else self.root / sha

    def get(self, sha: str) -> dict[str, Any] | None:
        """The stored outcome for `sha`, or None (missing, half-written or unreadable)."""
        if not self.persistent:
            return None  # staging for one run: nothing to reuse
        try:
            entry = json.loads(self._base(sha).with_suffix(".json").read_text())
        except (OSError, ValueError):
            return None
        if "reject" not in entry and not self.image_path(sha, entry["ext"]).is_file():
            return None
        if "mask_source" in entry and not self.mask_path(sha).is_file():
            return None
        if any(not self.reference_path(sha, i).is_file() for i in range(entry.get("references", 0))):
            return None
        return entry

    def image_path(self, sha: str, ext: str) -> Path:
        return self._base(sha).with_suffix(ext)

    def mask_path(self, sha: str) -> Path:
        return self._base(sha).with_suffix(".mask.png")

    def reference_path(self, sha: str, index: int) -> Path:
        return self._base(sha).with_suffix(f".ref{index}.png")

    def put(self, sha: str, entry: dict[str, Any], image: bytes | None = None, mask: bytes | None = None,
            references: tuple[bytes, ...] | list[bytes] = ()) -> None:
        """Write the image, mask and references (if any), then the entry; each appears atomically."""
        base = self._base(sha)
        if self.persistent:
            base.parent.mkdir(parents=True, exist_ok=True)
        if image is not None:
            _write_atomic(self.image_path(sha, entry["ext"]), image)
        if mask is not None:
            _write_atomic(self.mask_path(sha), mask)
        for i, data in enumerate(references):
            _write_atomic(self.reference_path(sha, i), data)
        if self.persistent:
            _write_atomic(base.with_suffix(".json"), json.dumps(entry, sort_keys=True).encode())

    def materialize(self, sha: str, ext: str, dest: Path, mask: bool = False, reference: int | None = None) -> None:
        """Put the processed image (or with `mask`, its mask; with `reference`, that reference) at `dest`:
        a copy from a persistent cache, else a move."""
        if reference is not None:
            src = self.reference_path(sha, reference)
        else:
            src = self.mask_path(sha) if mask else self.image_path(sha, ext)
        if self.persistent:
            shutil.copyfile(src, dest)
        else:
            os.replace(src, dest)


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def open_store(cache_dir: Path | None, fp: str, out_dir: Path) -> Store:
    """The store for this run: `<cache_dir>/<fp>` (marked used, old sets pruned) or a temp dir."""
    if cache_dir is None:
        staging = safe_remove.mark(Path(tempfile.mkdtemp(prefix=".staging-", dir=out_dir)), KIND)
        return Store(staging, persistent=False)
    root = safe_remove.mark(Path(cache_dir) / fp, KIND)
    (root / USED).write_text(f"{time.time()}\n")
    _prune(Path(cache_dir), keep=root)
    log.info("ingest cache: %s", root)
    return Store(root, persistent=True)


def _legacy_set(d: Path) -> bool:
    """A parameter set written before the marker: `<16 hex>/` holding `.last_used` and `<2 hex>/` folders."""
    if len(d.name) != 16 or not set(d.name) <= _HEX or d.is_symlink() or not (d / USED).is_file():
        return False
    others = [c for c in d.iterdir() if c.name != USED]
    return all(len(c.name) == 2 and set(c.name) <= _HEX and c.is_dir() and not c.is_symlink() for c in others)


def _prune(cache_dir: Path, keep: Path) -> None:
    """Delete all but the KEEP_FINGERPRINTS most recently used parameter sets; nothing else."""
    def last_used(d: Path) -> float:
        try:
            return (d / USED).stat().st_mtime
        except OSError:
            return 0.0

    sets = [d for d in cache_dir.iterdir() if d.is_dir() and d != keep]
    ours = [d for d in sets if safe_remove.is_marked(d, KIND) or _legacy_set(d)]
    if len(ours) < len(sets):
        log.debug("ingest cache: %d folders in %s are not the cache's: left alone", len(sets) - len(ours), cache_dir)
    for old in sorted(ours, key=last_used, reverse=True)[KEEP_FINGERPRINTS - 1 :]:
        log.info("ingest cache: removing results of older parameters %s", old)
        safe_remove.mark(old, KIND)  # a legacy set: recognised by its layout above
        safe_remove.remove_marked(old, KIND)


def close_store(store: Store) -> None:
    """Remove a temporary store (a persistent cache stays)."""
    if not store.persistent:
        safe_remove.remove_marked(store.root, KIND)
