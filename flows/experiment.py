"""Flow overrides as DVC experiments: the run happens in a workspace of its own.

`dvc exp run --set-param` in the workspace would leave the overrides in the tracked params.yaml
(and the outputs of the overridden run in models/), so every later run, the nightly one included,
would inherit them; `dvc exp run --temp` leaves out the inputs git does not track (the subject
folder, a persisted class-image folder), so it would redo work or fail.
This module does what `--temp` does, with those inputs carried over:

1. `git worktree add --detach` of HEAD under `.dvc/tmp/flow-exps/<name>` (git-ignored), sharing
   the repository's refs and DVC cache (`dvc cache dir --local`);
2. the workspace's uncommitted changes to tracked files and its untracked files that git does
   not ignore are carried over; the overrides are written into the experiment's params.yaml only;
   then every dep and out of dvc.yaml that git does not track, as DVC reads dvc.yaml there (its
   `${...}` filled in from that params.yaml, overrides included: `${ingest.data_dir}`, the
   folder of your images, which its manifest stage lists), is carried over: copied,
   except the files of cached outputs, which are hard-linked when possible (before a stage runs,
   DVC deletes its outputs, or for a `persist: true` one copies every hard-linked file back into
   a file of its own, and stages write outputs to a new folder, so a link is never written
   through; dvc.lock, params.yaml, .gitignore and reports are written in place and are always
   copies);
3. after the stages ran, `dvc exp save --name <name>` records the experiment in the repository,
   listed by `dvc exp show` and restorable with `dvc exp apply <name>`;
4. the worktree is removed, success or failure. The workspace, params.yaml and dvc.lock included,
   is left exactly as it was.

Deletion stays inside what this module made: `.dvc/tmp/flow-exps` carries the project's marker
(tasks/common/safe_remove.py) and only a workspace directly inside it is removed; carrying over
replaces only paths inside the new worktree (a dvc.yaml path outside the repository, absolute or
through `..`, is not carried, and nothing outside the worktree is replaced).
"""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from flows.dvc_stage import run_dvc
from flows.params import apply_overrides
from tasks.common import safe_remove
from tasks.common.errors import UserError

EXPERIMENTS_DIR = Path(".dvc/tmp/flow-exps")
KIND = "flow-experiments"  # the marker's kind on EXPERIMENTS_DIR

log = logging.getLogger(__name__)


def experiment_name(flow_run_id: str | None = None) -> str:
    """A DVC experiment name: `flow-<UTC time>[-<flow run id prefix>]`."""
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    suffix = f"-{flow_run_id[:8]}" if flow_run_id else ""
    return f"flow-{stamp}{suffix}"


def _git(root: Path, *args: str, check: bool = True) -> str:
    proc = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise UserError(f"`git {' '.join(args)}` failed in {root}: {proc.stderr.strip()}")
    return proc.stdout


def require_git(root: Path) -> None:
    """Overrides run as DVC experiments, which live in git: say so before anything runs."""
    inside = subprocess.run(["git", "rev-parse", "--verify", "-q", "HEAD"], cwd=root,
                            capture_output=True, text=True)
    if inside.returncode != 0:
        raise UserError(
            f"overrides run as DVC experiments, which need {root} to be a git repository with at "
            "least one commit (git init && git add -A && git commit -m init); or change "
            "params.yaml and run without overrides"
        )
    top = Path(_git(root, "rev-parse", "--show-toplevel").strip()).resolve()
    if top != Path(root).resolve():
        raise UserError(f"overrides run as DVC experiments from the git top level; {root} is "
                        f"inside {top}: run the flow from a repository of its own")


def _null_split(text: str) -> list[str]:
    return [p for p in text.split("\0") if p]


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _inside_worktree(dest: Path, rel: str) -> bool:
    """Whether `dest/rel` stays inside the worktree `dest` (no absolute path, no `..`, no linked parent)."""
    path = Path(rel)
    if path.is_absolute() or ".." in path.parts or not path.parts:
        return False
    parent = (dest / path).parent.resolve()
    return parent == dest.resolve() or dest.resolve() in parent.parents


def _carry(root: Path, dest: Path, rel: str, link: bool = False) -> None:
    if not _inside_worktree(dest, rel):
        log.warning("not carrying %s into the experiment: it lies outside the repository", rel)
        return
    src, dst = root / rel, dest / rel
    if dst.is_symlink() or dst.is_file():
        dst.unlink()
    elif dst.is_dir():
        shutil.rmtree(dst)
    if not (src.exists() or src.is_symlink()):
        return  # deleted in the workspace: deleted in the experiment too
    dst.parent.mkdir(parents=True, exist_ok=True)
    copy = _link_or_copy if link else shutil.copy2
    if src.is_symlink():
        os.symlink(os.readlink(src), dst)
    elif src.is_dir():
        shutil.copytree(src, dst, symlinks=True, copy_function=copy)
    else:
        copy(str(src), str(dst))


def _repo_path(entry: Any, root_dir: str) -> str | None:
    """A DVC dep or out as a path relative to the repository (its stage's `wdir` applied; an
    absolute one as written); None for one that is not a local path (a URL, a remote)."""
    if entry.protocol != "local":
        return None
    if os.path.isabs(entry.def_path):
        return str(entry.def_path)
    return os.path.relpath(entry.fs_path, root_dir)


def _pipeline_paths(dest: Path) -> tuple[list[str], set[str]]:
    """Every dep, out, metric and plot path of the stages in `dest`'s dvc.yaml, as DVC resolves
    them (`${...}` from `dest`'s params.yaml, foreach/matrix expanded); and the linkable ones
    (cached outs that are no metric or plot; DVC un-links a persistent one's files before its
    stage runs: Output.unprotect). Params files are not paths to carry."""
    from dvc.dependency.param import ParamsDependency
    from dvc.exceptions import DvcException
    from dvc.repo import Repo

    try:
        with Repo(str(dest)) as repo:
            stages = repo.stage.load_file(os.path.join(repo.root_dir, "dvc.yaml"))
            deps = [_repo_path(d, repo.root_dir) for s in stages for d in s.deps
                    if not isinstance(d, ParamsDependency)]
            outs = [(_repo_path(o, repo.root_dir), o.use_cache and not (o.metric or o.plot))
                    for s in stages for o in s.outs]
            deps += _manifest_folders(stages, repo.root_dir)
    except DvcException as err:
        raise UserError(f"DVC cannot read the pipeline in {dest}: {err}. Fix dvc.yaml or "
                        "params.yaml (or the overrides), then run again; `dvc stage list` shows "
                        "the same error") from err
    paths = [p for p in [*deps, *(path for path, _ in outs)] if p is not None]
    return list(dict.fromkeys(paths)), {path for path, link in outs if link and path is not None}


def _manifest_folders(stages: Any, root_dir: str) -> list[str]:
    """The data folders the stages' data manifests list (tasks/ingest/manifest.py): the pipeline
    reads them as much as a folder dependency, though its deps name only their manifest."""
    from tasks.ingest.deps import manifest_stages

    by_name = {s.name: s for s in stages}
    found = manifest_stages({name: {"cmd": s.cmd} for name, s in by_name.items()}, {})  # cmd: resolved
    return [m.data if os.path.isabs(m.data)
            else os.path.relpath(os.path.join(by_name[m.name].wdir, m.data), root_dir) for m in found]


def _untracked_by_git(root: Path, paths: list[str]) -> list[str]:
    tracked = set(_null_split(_git(root, "ls-files", "-z")))
    return [p for p in paths
            if (root / p).exists() and p not in tracked
            and not any(t.startswith(p.rstrip("/") + "/") for t in tracked)]


def populate(root: Path, dest: Path, overrides: Mapping[str, Any] | None = None) -> None:
    """Make `dest` (a worktree of HEAD) hold what the workspace holds, for the pipeline's sake,
    with `overrides` in its params.yaml; the pipeline's paths are read after they are written
    there, so a dependency named by a parameter (`${ingest.data_dir}`) is the one that runs."""
    changed = _null_split(_git(root, "diff", "--name-only", "-z", "HEAD"))
    untracked = _null_split(_git(root, "ls-files", "--others", "--exclude-standard", "-z"))
    for rel in [*changed, *untracked]:
        _carry(root, dest, rel)
    apply_overrides(dest / "params.yaml", overrides)
    paths, linkable = _pipeline_paths(dest)
    for rel in _untracked_by_git(root, paths):
        _carry(root, dest, rel, link=rel in linkable)
    for local in (".dvc/config.local",):
        if (root / local).is_file():
            shutil.copy2(root / local, dest / local)
    cache = run_dvc(root, "cache", "dir").stdout.strip().splitlines()[-1]
    run_dvc(dest, "cache", "dir", "--local", str(Path(cache).resolve()))


@contextmanager
def experiment_workspace(root: Path, name: str,
                         overrides: Mapping[str, Any]) -> Iterator[Path]:
    """A throw-away worktree of `root` with `overrides` in its params.yaml; removed on exit."""
    root = Path(root).resolve()
    require_git(root)
    if Path(name).name != name or name in ("", ".", ".."):
        raise UserError(f"experiment name {name!r} must be a plain name (no path separators)")
    dest = root / EXPERIMENTS_DIR / name
    if dest.exists():
        raise UserError(f"{dest} already exists: another experiment named '{name}' is running")
    safe_remove.mark(dest.parent, KIND)
    _git(root, "worktree", "add", "--detach", str(dest), "HEAD")
    try:
        populate(root, dest, overrides)
        yield dest
    finally:
        _git(root, "worktree", "remove", "--force", str(dest), check=False)
        safe_remove.remove_marked(dest, KIND, owner=dest.parent)
        _git(root, "worktree", "prune", check=False)


def save_experiment(dest: Path, name: str) -> dict[str, str]:
    """`dvc exp save --name <name>` in the experiment workspace; its name and commit."""
    run_dvc(dest, "exp", "save", "--name", name)
    for line in _null_split(_git(dest, "for-each-ref", "--format=%(objectname) %(refname)",
                                 "refs/exps").replace("\n", "\0")):
        sha, _, ref = line.partition(" ")
        if ref.endswith(f"/{name}") and not ref.startswith("refs/exps/exec/"):
            return {"name": name, "rev": sha}
    raise UserError(f"`dvc exp save` did not leave an experiment ref named '{name}'")
