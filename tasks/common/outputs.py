"""Writing outputs so that a crash never leaves a half-written result that looks complete.

Everything is written to a temporary sibling first and moved into place only on success.

A folder output replaces what was at its path: the stage's own earlier output (the paths come from
dvc.yaml's outs). A path that can never be an output (the repository or the working directory, an
ancestor of either, `/`, home, `.git`, a folder holding git-tracked files: safe_remove.refusal) is
refused before anything is written, so a mistyped `--out` replaces nothing of the user's.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tasks.common.errors import UserError
from tasks.common.safe_remove import refusal


@contextmanager
def atomic_dir(path: Path | str) -> Iterator[Path]:
    """Yield a fresh temporary directory; on success it replaces `path`, on error it is removed."""
    path = Path(path)
    if why := refusal(path):
        raise UserError(f"refusing to write an output folder at {path}: it {why}, and writing it would replace "
                        "what is there; pass --out a folder of the pipeline's own (dvc.yaml's outs)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the output is an ordinary folder
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if path.exists() or path.is_symlink():
        old = path.with_name(f".{path.name}.old-{os.getpid()}")
        os.replace(path, old)
        os.replace(tmp, path)
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink()
    else:
        os.replace(tmp, path)


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
    os.replace(tmp, path)


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
