"""Deleting only what the project made: one marker file per folder it creates, checked before removal.

A folder the code deletes under (the ingest cache's parameter sets, the train stage's checkpoint
folders, a flow's experiment workspaces) comes from a configurable path. A mistyped path must
never cost the user anything: `ingest.cache_dir: .` once pruned the repository's `.git`, `data`
and `models`. Two guards, used by every stage through this one module:

- `mark(folder, kind)` writes `MARKER` (a small JSON naming the project and the kind of folder)
  into each folder the code creates; `remove_marked` deletes a folder only when it, or the
  `owner` folder it sits directly in, carries the marker of that kind. Anything else is kept and
  logged.
- `refusal(path)` says why a path must never be a folder of ours: the file system root, the home
  directory or an ancestor of it, the repository or the working directory or an ancestor of
  either, anything inside a `.git` folder, another git repository, or a folder holding files git
  tracks. Stage configs call it through `own_folder` at load time (a pydantic validator), so the
  error names the params key; `remove_marked` checks it again before deleting.
"""
from __future__ import annotations

import json
import logging
import shutil
import subprocess
from pathlib import Path

log = logging.getLogger(__name__)

MARKER = ".sd-finetune-owned"
PROJECT = "sd-finetune-pipeline"
REPO = Path(__file__).resolve().parents[2]


def mark(folder: Path, kind: str, marker: str = MARKER) -> Path:
    """Create `folder` (and parents) if needed and mark it as the project's, of `kind`.

    `marker`: the marker file's name (stage outputs use their own: tasks/common/outputs.py)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if not is_marked(folder, kind, marker):
        (folder / marker).write_text(json.dumps({"made_by": PROJECT, "kind": kind}) + "\n")
    return folder


def is_marked(folder: Path, kind: str, marker: str = MARKER) -> bool:
    """Whether `folder` (not a symlink) carries the project's marker of `kind` (in file `marker`)."""
    folder = Path(folder)
    if folder.is_symlink() or not folder.is_dir():
        return False
    try:
        data = json.loads((folder / marker).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("made_by") == PROJECT and data.get("kind") == kind


def _tracked_by_git(path: Path) -> bool:
    """Whether `path` is, or holds, a file git tracks (False outside a repository or without git)."""
    where = path if path.is_dir() else path.parent
    try:
        proc = subprocess.run(["git", "-C", str(where), "ls-files", "-z", "--", str(path)],
                              capture_output=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return False
    return proc.returncode == 0 and bool(proc.stdout.strip(b"\0"))


def refusal(path: Path, git: bool = True) -> str | None:
    """Why `path` can never be a folder the code deletes under; None when it can be.

    `git=False` leaves out the checks that ask git (another repository, tracked files): for removing
    a marked folder, such as a worktree the code added itself."""
    resolved = Path(path).expanduser().resolve()
    if resolved == Path(resolved.anchor):
        return "is the file system root"
    home = Path.home().resolve()
    if resolved == home or resolved in home.parents:
        return f"is the home directory ({home}) or an ancestor of it"
    for base, what in ((REPO, "the repository"), (Path.cwd().resolve(), "the working directory")):
        if resolved == base or resolved in base.parents:
            return f"is {what} ({base}) or an ancestor of it"
    if ".git" in resolved.parts:
        return "is inside a .git folder"
    if git and (resolved / ".git").exists():
        return "is a git repository"
    if git and resolved.exists() and _tracked_by_git(resolved):
        return "holds files tracked by git"
    return None


def own_folder(path: Path | None, example: str) -> Path | None:
    """Pydantic validator body for a params path the code deletes under: refuse an unsafe one."""
    if path is None:
        return None
    why = refusal(path)
    if why:
        raise ValueError(f"{Path(path).as_posix()} {why}: the stage keeps its own folders under it and "
                         f"deletes old ones, so it must be a folder of its own; set it to one such as {example}")
    return path


def remove_marked(folder: Path, kind: str, owner: Path | None = None) -> bool:
    """Delete `folder` if it, or `owner` (its parent), carries the marker of `kind`; True if it went.

    Anything else (unmarked, a symlink, not directly inside `owner`, or a path `refusal` names) is
    kept, and the reason logged."""
    folder = Path(folder)
    if not (folder.exists() or folder.is_symlink()):
        return False
    if owner is not None:
        inside = folder.parent.resolve() == Path(owner).resolve() and not folder.is_symlink()
        ours = inside and is_marked(Path(owner), kind)
    else:
        ours = is_marked(folder, kind)
    why = refusal(folder, git=False) if ours else f"carries no {MARKER} marker of kind {kind!r}"
    if why:
        log.warning("not removing %s: %s (the project deletes only folders it made)", folder, why)
        return False
    shutil.rmtree(folder, ignore_errors=True)
    return True
