"""Writing outputs so that a crash never leaves a half-written result that looks complete.

Everything is written to a temporary sibling first and moved into place only on success
(`publish`): the temporary file or folder is flushed to disk (every file, then every folder) before
the rename and the parent folder after it, so even a power cut leaves either the old result or
the complete new one, never a final name over missing data. Checkpoints use the same helper.

A folder output replaces only what the stage wrote before. `atomic_dir` writes `OUTPUT_MARKER`
into each folder it makes, inside the output, so DVC caches it with the output and a folder DVC
restores carries it too. An existing folder at the path is replaced only when it carries that
marker or is empty; anything else (a user's folder, a file, a link, an output written before the
marker existed) is refused before the stage starts, naming the path and the fix. A path that can
never be an output (the repository or the working directory, an ancestor of either, `/`, home,
`.git`, a folder holding git-tracked files: safe_remove.refusal) is refused whatever it holds.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tasks.common.errors import UserError
from tasks.common.safe_remove import is_marked, mark, refusal

# A .json name: `dvc plots` reads every file of a plots folder (reports/evaluate) and refuses a
# name without a known extension, while a JSON file without a list in it only gives no plot.
OUTPUT_MARKER = ".sd-finetune-output.json"
OUTPUT_KIND = "stage-output"


def fsync_dir(folder: Path) -> None:
    """Flush a folder's entries (names created, renamed or removed in it) to disk."""
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as err:  # a file system that cannot sync a folder (some network ones)
        if err.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def sync_tree(path: Path) -> None:
    """Flush `path` to disk: a file, or a folder's files, then its folders, the deepest first."""
    path = Path(path)
    if not path.is_dir() or path.is_symlink():
        if not path.is_symlink():
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())
        return
    folders = []
    for here, _, files in os.walk(path):
        folders.append(here)
        for name in files:
            sync_tree(Path(here) / name)
    for folder in reversed(folders):  # os.walk lists a folder before its sub-folders
        fsync_dir(Path(folder))


def publish(tmp: Path, final: Path) -> None:
    """Move the finished `tmp` (a file or folder) to `final`, durably: `tmp` flushed first, then the
    rename, then the parent folder. An existing `final` is replaced (a folder by way of a hidden
    `.old` sibling, since a rename cannot replace a non-empty folder)."""
    tmp, final = Path(tmp), Path(final)
    sync_tree(tmp)
    old = None
    if tmp.is_dir() and (final.exists() or final.is_symlink()):
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink()


def check_replaceable(path: Path | str) -> None:
    """Refuse an output path whose current content this project did not write as an output (atomic_dir
    checks on entry; a stage that writes its output only after minutes of work calls it at its start)."""
    path = Path(path)
    if why := refusal(path):
        raise UserError(f"refusing to write an output folder at {path}: it {why}, and writing it would replace "
                        "what is there; pass --out a folder of the pipeline's own (dvc.yaml's outs)")
    if not (path.exists() or path.is_symlink()):
        return
    if path.is_symlink() or not path.is_dir():
        what = "is a link" if path.is_symlink() else "is a file"
    elif is_marked(path, OUTPUT_KIND, OUTPUT_MARKER) or not any(path.iterdir()):
        return
    else:
        what = f"is a folder without the {OUTPUT_MARKER} marker a stage writes into its outputs"
    raise UserError(f"refusing to replace {path}: it {what}, so no stage wrote it and replacing it could lose "
                    f"someone's files. Delete it yourself if it is an old output (one written before the marker "
                    f"existed, or a copy of one), or choose another --out")


@contextmanager
def atomic_dir(path: Path | str) -> Iterator[Path]:
    """Yield a fresh temporary directory; on success it is marked as an output and replaces `path`
    (only an empty folder or an earlier output: `check_replaceable`); on error it is removed."""
    path = Path(path)
    check_replaceable(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the output is an ordinary folder
    try:
        yield tmp
        mark(tmp, OUTPUT_KIND, OUTPUT_MARKER)
        check_replaceable(path)  # again: something may have appeared there while the stage ran
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish(tmp, path)


@contextmanager
def atomic_file(path: Path | str) -> Iterator[Path]:
    """Yield a temporary file path next to `path`; it is moved onto `path` only on success."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent, suffix=path.suffix)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    publish(tmp, path)


def write_json(path: Path | str, data: Any) -> None:
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def link_tree(src: Path | str, dst: Path | str) -> None:
    """Copy folder `src` to `dst` (which must not exist) by hard links where the filesystem allows,
    so that shared model files are not written twice; plain copies elsewhere. Files are never
    changed in place afterwards (outputs are replaced whole), so the links stay safe."""
    def link(a: str, b: str) -> None:
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)

    shutil.copytree(src, dst, copy_function=link)
