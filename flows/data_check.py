"""Before any DVC call of the flow: no folder DVC hashes itself may hold a file it would block on.

The data folder of dvc.yaml's pipeline is versioned through its manifest (tasks/ingest/manifest.py),
which never opens a FIFO, socket or device. A folder tracked with `dvc add` (a `.dvc` file: the
team's way to share `ingest.data_dir` through a DVC remote, flows/remote.py) is hashed by DVC
itself: `dvc status`, `dvc pull` and `dvc push` open every file in it, and block for ever on a
FIFO. So the flow looks at each such folder first (`lstat` only, bounded) and refuses, naming
every special file and the fix, before DVC could stall on it.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from tasks.common.errors import UserError
from tasks.ingest.manifest import FIX, special_files


def tracked_folders(root: Path) -> list[tuple[Path, Path]]:
    """(`.dvc` file, the path it tracks) for every `.dvc` file git sees in `root` (committed or not)."""
    proc = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", "*.dvc"],
                          cwd=root, capture_output=True)
    files = [root / name for name in proc.stdout.decode().split("\0") if name] if proc.returncode == 0 else []
    found = []
    for dvc_file in files:
        try:
            outs = (yaml.safe_load(dvc_file.read_text()) or {}).get("outs") or []
        except (OSError, yaml.YAMLError, AttributeError):
            continue  # DVC names a broken .dvc file itself, at once
        for out in outs:
            if isinstance(out, dict) and out.get("path"):
                found.append((dvc_file, dvc_file.parent / str(out["path"])))
    return found


def check_tracked_folders(root: Path) -> None:
    """A UserError naming each FIFO, socket or device (or link to one) in a `.dvc`-tracked folder."""
    blocks = []
    for dvc_file, path in tracked_folders(root):
        if not path.is_dir() or path.is_symlink():
            continue
        found = special_files(path)
        if found:
            blocks.append(f"{path.relative_to(root)} is tracked by {dvc_file.relative_to(root)}, so DVC hashes "
                          "it itself and would block for ever on:\n"
                          + "\n".join(f"  {p.relative_to(root)}: {what}" for p, what in found))
    if blocks:
        raise UserError("\n".join(blocks) + f"\nFor each: {FIX} (then `dvc add` the folder again). Nothing ran.")
