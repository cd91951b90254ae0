"""The team's DVC remote: what a flow run pulls before its stages and pushes after them.

With a default DVC remote (`dvc remote add -d <name> <url>`, committed in .dvc/config), the
workspace is one of several machines that share data and models through it:

- `check_shared`, before anything runs: every input of dvc.yaml's stages that lies in the
  repository must be versioned, by git or by DVC (a `.dvc` file, a stage's output), or a clone on
  another machine would not have it (the usual case: `ingest.data_dir`, which the team tracks with
  `dvc add`); and a `.dvc`-tracked folder must not hold changes its `.dvc` file does not record
  (they would train here and be missing everywhere else).
- `check_verify`: the remote must have DVC's `verify = true`, so that every object pulled is
  hashed again and one whose content does not match its name (rewritten on the remote by any
  holder of its keys) is refused: the stage then runs instead.
- `pull_sources`: the `.dvc`-tracked inputs missing here (a new clone, an empty cache) are pulled.
  The stages' own outputs are pulled stage by stage by `dvc repro --pull --no-run-cache`
  (flows/dvc_stage.py): an unchanged stage's outputs (named by dvc.lock, from git) come from the
  remote instead of being recomputed; the remote's run-cache is never used, since an entry in it
  could restore a stage that never ran (a forged evaluation report).
- `push`, after the stages: `dvc push --run-cache` sends every output of dvc.lock, the
  `.dvc`-tracked inputs and the run-cache, so the registered model version can name the remote
  where its data lives (tag `dvc.remote`).

Without a default remote none of this happens: one machine, its own cache.
"""
from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from flows.dvc_stage import MISSING, dvc_status, output_tail, run_dvc
from tasks.common.errors import UserError

#: The model version tag (and parent run tag) naming the remote that holds the version's data.
REMOTE_TAG = "dvc.remote"


@dataclass(frozen=True)
class Remote:
    name: str
    url: str  # without credentials
    verify: bool = False  # DVC's `verify`: pulled objects are hashed again

    def describe(self) -> str:
        """`<name> <url>`: the value of the `dvc.remote` tag."""
        return f"{self.name} {self.url}"


def _without_credentials(url: str) -> str:
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit(parts._replace(netloc=netloc))


def default_remote(root: Path) -> Remote | None:
    """The workspace's default DVC remote (.dvc/config, config.local), or None."""
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        config = repo.config
        name = config["core"].get("remote")
        if not name:
            return None
        remote = config["remote"].get(name)
        if remote is None:
            raise UserError(f"{root}/.dvc/config names '{name}' as the default DVC remote, but no "
                            f"remote '{name}' is defined: `dvc remote add -d {name} <url>`")
        return Remote(name, _without_credentials(str(remote["url"])), bool(remote.get("verify")))


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


@dataclass(frozen=True)
class Inputs:
    """dvc.yaml's inputs as DVC sees them (paths relative to the repository root)."""

    deps: list[str]      # every stage's deps inside the repository
    outside: list[str]   # deps outside it (absolute paths: shared storage, not the remote)
    outs: list[str]      # every output: stages' and `.dvc` files'
    sources: list[str]   # the `.dvc` files


def pipeline_inputs(root: Path) -> Inputs:
    from dvc.repo import Repo

    deps: list[str] = []
    outside: list[str] = []
    outs: list[str] = []
    sources: list[str] = []
    with Repo(str(root)) as repo:
        top = repo.root_dir
        for stage in repo.index.stages:
            if stage.is_data_source:
                sources.append(os.path.relpath(stage.path, top))
            for out in stage.outs:
                outs.append(os.path.relpath(out.fs_path, top))
            for dep in stage.deps:
                if dep.protocol != "local":
                    continue  # a URL: DVC reads it from there on every machine
                if dep.is_in_repo:
                    deps.append(os.path.relpath(dep.fs_path, top))
                else:
                    outside.append(dep.fs_path)
    for folder in _manifest_folders(root, outs):
        (outside if os.path.isabs(folder) else deps).append(folder)
    return Inputs(sorted(set(deps)), sorted(set(outside)), sorted(set(outs)), sorted(sources))


def _manifest_folders(root: Path, outs: list[str]) -> list[str]:
    """The data folders dvc.yaml's data manifest stages list (tasks/ingest/manifest.py): inputs of
    the pipeline as much as a folder dependency, though DVC only sees their manifest."""
    import yaml

    from tasks.ingest.deps import manifest_stages

    params = yaml.safe_load((root / "params.yaml").read_text()) if (root / "params.yaml").is_file() else {}
    stages = (yaml.safe_load((root / "dvc.yaml").read_text()) or {}).get("stages") or {}
    return [os.path.normpath(m.data) for m in manifest_stages(stages, params or {})
            if os.path.normpath(m.out) in outs]


def _git_tracks(root: Path, path: str) -> bool:
    proc = subprocess.run(["git", "ls-files", "--", path], cwd=root, capture_output=True,
                          text=True)
    return proc.returncode == 0 and bool(proc.stdout.strip())


def unshared_inputs(root: Path, inputs: Inputs) -> list[str]:
    """Inputs in the repository that neither git nor DVC versions: no clone has them."""
    return [dep for dep in inputs.deps
            if not any(_inside(dep, out) for out in inputs.outs) and not _git_tracks(root, dep)]


def _status(root: Path, targets: list[str]) -> dict[str, dict[str, str]]:
    """`dvc status` of `targets`: {dvc file: {path: verdict}} for the changed ones."""
    found: dict[str, dict[str, str]] = {}
    for target, entries in dvc_status(root, tuple(targets)).items():
        for entry in entries:
            if isinstance(entry, dict):
                for what in entry.values():
                    if isinstance(what, dict):
                        found.setdefault(target, {}).update(what)
    return found


def check_shared(root: Path, remote: Remote, inputs: Inputs) -> None:
    """Fail, naming the path and the fix, when a clone elsewhere could not get an input."""
    unshared = unshared_inputs(root, inputs)
    if unshared:
        first = unshared[0]
        raise UserError(
            f"with a DVC remote ('{remote.name}'), every input of dvc.yaml must be versioned, but "
            f"{', '.join(unshared)} is tracked by neither git nor DVC: another machine's clone "
            f"would not have it. Track it with DVC (the flow then pushes it to '{remote.name}'): "
            f"dvc add {first} && git add {first}.dvc && git commit -m 'track {first}'; or "
            "remove the default remote to run on this machine only (dvc remote default --unset)"
        )
    status = _status(root, inputs.sources) if inputs.sources else {}
    edited = {target: paths for target, paths in status.items()
              if any(v not in MISSING for v in paths.values())}
    if edited:
        target, paths = next(iter(edited.items()))
        folder = next(iter(paths))
        raise UserError(
            f"{folder} has changes that {target} does not record ({', '.join(f'{p} {v}' for p, v in paths.items())}): "
            f"other machines would not get them. Record them first: dvc add {folder} && git "
            f"commit {target} -m 'update {folder}' (the flow then pushes them to "
            f"'{remote.name}'); or undo them: dvc checkout {target}"
        )


def check_verify(remote: Remote) -> None:
    """Refuse a remote whose pulls are not verified: a rewritten object would be used as is."""
    if not remote.verify:
        raise UserError(
            f"DVC remote '{remote.name}' ({remote.url}) does not verify what it pulls: an object "
            "rewritten on the remote by anyone holding its keys (a forged model or evaluation "
            "report under a genuine md5) would be used as is. Turn verification on and commit "
            f"it: dvc remote modify {remote.name} verify true && git add .dvc/config && git "
            "commit -m 'verify DVC pulls'"
        )


def pull_sources(root: Path, remote: Remote, inputs: Inputs,
                 log: Callable[[str], None] = print) -> list[str]:
    """`dvc pull` the `.dvc`-tracked inputs that are missing here; the ones pulled."""
    missing = sorted(_status(root, inputs.sources)) if inputs.sources else []
    if not missing:
        return []
    log(f"pulling {', '.join(missing)} from DVC remote {remote.describe()}")
    proc = run_dvc(root, "pull", *missing, check=False)
    if proc.returncode != 0:
        raise UserError(
            f"`dvc pull {' '.join(missing)}` from DVC remote {remote.describe()} failed: the "
            "machine that last ran `dvc add` on it must also push it (`dvc push`, or a flow run "
            f"there); check the remote's credentials (.dvc/config.local) and reach.\n{output_tail(proc)}"
        )
    return missing


def prepare(root: Path, log: Callable[[str], None] = print) -> Remote | None:
    """Before a run: the default remote (None: none), the inputs checked, the missing `.dvc`
    inputs pulled."""
    remote = default_remote(root)
    if remote is None:
        return None
    check_verify(remote)
    inputs = pipeline_inputs(root)
    check_shared(root, remote, inputs)
    if inputs.outside:
        log(f"inputs outside the repository, not carried by DVC remote '{remote.name}' (every "
            f"machine needs them at the same path): {', '.join(inputs.outside)}")
    pull_sources(root, remote, inputs, log)
    return remote


def push(root: Path, remote: Remote, log: Callable[[str], None] = print) -> str:
    """`dvc push --run-cache`: every output of dvc.lock, the `.dvc` inputs and the run-cache."""
    log(f"pushing the pipeline's data and models to DVC remote {remote.describe()}")
    proc = run_dvc(root, "push", "--run-cache", check=False)
    if proc.returncode != 0:
        raise UserError(
            f"`dvc push` to DVC remote {remote.describe()} failed, so nothing was registered: "
            "the outputs are in this machine's DVC cache only. Fix the remote (reach, "
            "credentials in .dvc/config.local) and run again: the finished stages are skipped."
            f"\n{output_tail(proc)}"
        )
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "pushed"
    log(f"dvc push: {summary}")
    return summary
