"""What DVC versions of the data folder: a manifest, so that no file there can stall DVC.

`python -m tasks.ingest.manifest --data DIR --out reports/data_manifest.json [--state FILE]`

DVC hashes a folder dependency by opening every file in it (dvc_data's `_build_tree` ->
`file_md5`, with no check of the file's type): a FIFO there blocks `dvc repro` and `dvc status`
for ever, a character device (or a link to /dev/zero) never ends. So the ingest stage does not
depend on the data folder itself but on this manifest of it, which the `data_manifest` stage
(`always_changed: true`, so it runs first in every `dvc repro`) writes after looking at each entry
with `lstat` only:

- a regular file: its size and SHA-256 (read non-blocking, checked again on its descriptor);
- a symbolic link: where it points (the link is never followed: what it points to inside the
  folder is listed under its own path, anything outside is not ingest's to read);
- a FIFO, socket or device: its kind, never opened; a file or folder that cannot be read: the error.

Any change to the folder (a new, edited, removed or renamed image, a caption, a link, a FIFO
appearing) changes the manifest's bytes, so DVC reruns ingest; an unchanged folder writes the
same bytes, so ingest is skipped. Ingest itself then rejects each special file with its reason
(`not_regular_file` in reports/ingest_rejected.jsonl); the manifest stage only names them.

`--state`: a cache of hashes keyed by path, inode, size and modification times (as DVC's own
state does), so an unchanged file is not read again; optional, deleting it is always safe.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import stat
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from tasks.common.confine import confine

log = logging.getLogger(__name__)

#: The module dvc.yaml's manifest stage runs, as its command names it.
COMMAND = "python -m tasks.ingest.manifest"
VERSION = 1
_CHUNK = 1 << 20

_SPECIAL = ((stat.S_ISFIFO, "fifo", "a FIFO (named pipe)"), (stat.S_ISSOCK, "socket", "a socket"),
            (stat.S_ISCHR, "char_device", "a character device"),
            (stat.S_ISBLK, "block_device", "a block device"))
FIX = "remove it, or replace it with the file itself"


def special_kind(mode: int) -> tuple[str, str] | None:
    """(kind, words) of a FIFO, socket or device; None for a regular file, folder or link."""
    return next(((kind, words) for test, kind, words in _SPECIAL if test(mode)), None)


def _sha256(path: Path) -> str:
    """SHA-256 of a regular file, opened non-blocking and checked on its descriptor (a file swapped
    for a FIFO between lstat and open cannot block)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
            raise OSError(f"{path} is no longer a regular file")
        digest = hashlib.sha256()
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _walk(root: Path, errors: dict[str, str]) -> Iterable[tuple[str, os.stat_result]]:
    """(posix path relative to root, lstat) of every entry below `root`, links not followed."""
    def onerror(err: OSError) -> None:
        rel = Path(err.filename).relative_to(root).as_posix() if err.filename else "."
        errors[rel or "."] = f"{type(err).__name__}: {err.strerror or err}"

    for folder, dirs, files in os.walk(root, onerror=onerror, followlinks=False):
        dirs.sort()
        base = Path(folder)
        # os.walk lists a link to a folder among `dirs` and does not enter it: list it here.
        for name in [*sorted(files), *(d for d in dirs if (base / d).is_symlink())]:
            path = base / name
            try:
                yield path.relative_to(root).as_posix(), os.lstat(path)
            except OSError as err:
                errors[path.relative_to(root).as_posix()] = f"{type(err).__name__}: {err.strerror or err}"


def build(root: Path, state: dict[str, Any] | None = None,
          warn: Callable[[str], None] = log.warning) -> dict[str, Any]:
    """The manifest of `root` (see the module docstring). `state` (path -> [inode, size, mtime_ns,
    ctime_ns, sha256]) is read and updated in place. Never opens anything but regular files."""
    root = Path(root)
    if not root.is_dir():
        return {"version": VERSION, "missing": True, "entries": {}}
    errors: dict[str, str] = {}
    entries: dict[str, dict[str, Any]] = {}
    seen: dict[str, Any] = {}
    for rel, info in _walk(root, errors):
        mode = info.st_mode
        if stat.S_ISLNK(mode):
            entries[rel] = {"link": os.readlink(root / rel)}
            try:
                special = special_kind(os.stat(root / rel).st_mode)  # stat follows the link, opens nothing
            except OSError:
                special = None  # a broken link or a loop: ingest says which
            if special:
                warn(f"{root / rel}: a link to {special[1]}, not to a regular file: never opened, ingest "
                     f"rejects it (not_regular_file); {FIX}")
        elif stat.S_ISREG(mode):
            key = [info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns]
            cached = (state or {}).get(rel)
            try:
                digest = cached[4] if cached and cached[:4] == key else _sha256(root / rel)
            except OSError as err:
                errors[rel] = f"{type(err).__name__}: {err.strerror or err}"
                continue
            seen[rel] = [*key, digest]
            entries[rel] = {"size": info.st_size, "sha256": digest}
        elif special := special_kind(mode):
            kind, words = special
            entries[rel] = {"special": kind}
            warn(f"{root / rel}: {words}, not a regular file: never opened, ingest rejects it "
                 f"(not_regular_file); {FIX}")
    for rel, error in errors.items():
        entries[rel] = {"unreadable": error}
        warn(f"{root / rel}: cannot be read ({error}): ingest cannot use it; make it readable or remove it")
    if state is not None:
        state.clear()
        state.update(seen)
    # Paths relative to the folder only: the same folder anywhere (a clone) gives the same bytes.
    return {"version": VERSION, "entries": dict(sorted(entries.items()))}


def special_files(root: Path) -> list[tuple[Path, str]]:
    """(path, what it is) of every FIFO, socket or device below `root`, and every link to one, by
    `lstat`/`stat` only: what DVC would block on or never finish reading if it hashed `root`."""
    found = []
    for rel, info in _walk(Path(root), {}):
        path = Path(root) / rel
        try:
            mode = os.stat(path).st_mode if stat.S_ISLNK(info.st_mode) else info.st_mode
        except OSError:
            continue  # a broken link: DVC fails on it at once, it does not block
        if special := special_kind(mode):
            found.append((path, ("a link to " if stat.S_ISLNK(info.st_mode) else "") + special[1]))
    return found


def dumps(manifest: Mapping[str, Any]) -> bytes:
    """The manifest's bytes: the same folder always gives the same bytes (what DVC hashes)."""
    return (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode()


def read_state(path: Path | None) -> dict[str, Any] | None:
    if path is None:
        return None
    try:
        data = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        data = {}
    return data if isinstance(data, dict) else {}


def _write_state(path: Path, state: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(state))
    tmp.replace(path)


def write(data: Path, out: Path, state_file: Path | None = None) -> dict[str, Any]:
    state = read_state(state_file)
    manifest = build(data, state)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(dumps(manifest))
    if state_file is not None and state is not None:
        try:
            _write_state(state_file, state)
        except OSError as err:  # a cache only
            log.warning("hash cache %s not written (%s): the next run reads every file again", state_file, err)
    return manifest


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n")[0], exit_on_error=False)
    parser.add_argument("--data", type=Path, required=True, help="the data folder (ingest.data_dir)")
    parser.add_argument("--out", type=Path, required=True, help="the manifest to write")
    parser.add_argument("--state", type=Path, default=None, help="hash cache (optional)")
    return parser


def main(argv: list[str] | None = None) -> int:
    confine("data_manifest")  # no credential: it only lists the data folder
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    manifest = write(args.data, args.out, args.state)
    entries = manifest["entries"].values()
    special = sum(1 for e in entries if "special" in e or "unreadable" in e)
    log.info("data manifest of %s: %d entries (%d not regular or unreadable) -> %s",
             args.data, len(manifest["entries"]), special, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
