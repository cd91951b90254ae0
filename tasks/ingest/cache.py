"""Content-addressed store of processed images, so a re-run processes only what is new.

Layout: `<cache_dir>/<fingerprint>/<sha[:2]>/<sha>.json` (the outcome: kept image facts or a
rejection) and `<sha>.<png|jpg>` (the processed image). `sha` is the SHA-256 of the source
file's bytes; `fingerprint` hashes every parameter that changes the processed pixels and the
source code that produces them, so a changed parameter or a code change never reuses stale
results (it starts a new fingerprint directory; only the most recent ones are kept).

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

log = logging.getLogger(__name__)

#: Source files whose code decides the processed pixels: part of the fingerprint.
_CODE = ("tasks/ingest/checks.py", "tasks/ingest/work.py", "tasks/common/images.py")
KEEP_FINGERPRINTS = 3  # parameter sets kept on disk (switching back and forth stays warm)
USED = ".last_used"


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
        return entry

    def image_path(self, sha: str, ext: str) -> Path:
        return self._base(sha).with_suffix(ext)

    def put(self, sha: str, entry: dict[str, Any], image: bytes | None = None) -> None:
        """Write the image (if any), then its entry; each appears atomically (write + rename)."""
        base = self._base(sha)
        if self.persistent:
            base.parent.mkdir(parents=True, exist_ok=True)
        if image is not None:
            _write_atomic(self.image_path(sha, entry["ext"]), image)
        if self.persistent:
            _write_atomic(base.with_suffix(".json"), json.dumps(entry, sort_keys=True).encode())

    def materialize(self, sha: str, ext: str, dest: Path) -> None:
        """Put the processed image at `dest`: a copy from a persistent cache, else a move."""
        src = self.image_path(sha, ext)
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
        return Store(Path(tempfile.mkdtemp(prefix=".staging-", dir=out_dir)), persistent=False)
    root = Path(cache_dir) / fp
    root.mkdir(parents=True, exist_ok=True)
    (root / USED).write_text(f"{time.time()}\n")
    _prune(Path(cache_dir), keep=root)
    log.info("ingest cache: %s", root)
    return Store(root, persistent=True)


def _prune(cache_dir: Path, keep: Path) -> None:
    """Delete all but the KEEP_FINGERPRINTS most recently used parameter sets."""
    def last_used(d: Path) -> float:
        try:
            return (d / USED).stat().st_mtime
        except OSError:
            return 0.0

    sets = sorted((d for d in cache_dir.iterdir() if d.is_dir()), key=last_used, reverse=True)
    for old in [d for d in sets if d != keep][KEEP_FINGERPRINTS - 1 :]:
        log.info("ingest cache: removing results of older parameters %s", old)
        shutil.rmtree(old, ignore_errors=True)


def close_store(store: Store) -> None:
    """Remove a temporary store (a persistent cache stays)."""
    if not store.persistent:
        shutil.rmtree(store.root, ignore_errors=True)
