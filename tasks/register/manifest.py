"""What was registered is what loads: a SHA-256 manifest of every file of a registered model.

At registration (tasks/register/core.py), right after the model is logged and before its version
is created, every file the store holds for the model (MLmodel, the model code, `code/`, the
weights under `artifacts/`, the environment files) is hashed into a manifest. The manifest is
logged into the version's run as `manifests/<model id>.json`, and its own SHA-256 as the run
param `manifest.<model id>`. After the last write of the run's lineage.json, that file's SHA-256
is the param `lineage.<model id>`.

Why params: MLflow refuses to change a logged param's value ("Changing param values is not
allowed"), keeps params through a run's deletion and restore, refuses to log to a deleted run,
and a version's `run_id` and `source` never change. The pipeline user can rewrite every artifact
through the artifact proxy (the manifest artifact included: its digest then disagrees with the
param) but not the param. tests/infra/test_team_stack.py checks this on the authenticated server.

Every load of a registered version checks the files it downloaded against the manifest and refuses
a changed, missing or added file by name (tasks/register/verified.py: where that happens, and
which loads are covered). A version registered without a manifest (before this existed, or by
other code) is refused, naming `FINETUNE_ALLOW_UNVERIFIED=1`, under which it loads with a warning.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

# the params' names and the capped read are the served model's too (an endpoint checks an adapter's lineage)
from finetune_runtime.registered import (
    LINEAGE_PARAM,
    MANIFEST_MAX_BYTES,
    MANIFEST_PARAM,
    TooLarge,
    fetch_capped,
    model_key,
)
from tasks.common.errors import UserError
from tasks.common.fingerprint import sha256_file

log = logging.getLogger(__name__)

MANIFEST_DIR = "manifests"
#: set to 1 to load (serve, re-score, promote over) a version registered without a manifest, unchecked
ALLOW_ENV = "FINETUNE_ALLOW_UNVERIFIED"
#: Written by MLflow itself into a downloaded registered model's root (name and version), every load.
MLFLOW_META = "registered_model_meta"


class ManifestMismatch(UserError):
    """A registered model's stored files differ from what was registered."""


def digest_tree(root: Path) -> dict[str, str]:
    """{path relative to `root` (POSIX): SHA-256} of every file under `root`, MLflow's own
    `registered_model_meta` at the root left out."""
    root = Path(root)
    files = sorted(p for p in root.rglob("*") if p.is_file() or p.is_symlink())
    return {p.relative_to(root).as_posix(): sha256_file(p) for p in files
            if p.relative_to(root).as_posix() != MLFLOW_META}


def _stored_tree(uri: str, work: Path) -> Path:
    """The folder holding the files at artifact `uri`: the store's own folder for a local store,
    else a download into `work`."""
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository
    from mlflow.store.artifact.local_artifact_repo import LocalArtifactRepository

    repo = get_artifact_repository(uri)
    if isinstance(repo, LocalArtifactRepository):
        return Path(repo.artifact_dir)
    work.mkdir(parents=True)
    return Path(repo.download_artifacts("", str(work)))


def record(client: Any, run_id: str, source: str, location: str) -> str:
    """Hash the model stored at `location` (its artifact URI), log the manifest into run `run_id`
    and its SHA-256 as the param; the param's key."""
    key = model_key(source)
    with tempfile.TemporaryDirectory(prefix="manifest-") as work:
        files = digest_tree(_stored_tree(location, Path(work) / "model"))
        doc = {"format": 1, "source": source, "files": files}
        text = json.dumps(doc, indent=1, sort_keys=True) + "\n"
        path = Path(work) / f"{key}.json"
        path.write_text(text)
        client.log_artifact(run_id, str(path), MANIFEST_DIR)
    digest = hashlib.sha256(text.encode()).hexdigest()
    client.log_param(run_id, MANIFEST_PARAM.format(key), digest)
    log.info("recorded the manifest of %s (%d files, sha256 %s) in run %s", source, len(files), digest[:12], run_id)
    return MANIFEST_PARAM.format(key)


def record_logged(client: Any, run_id: str, info: Any) -> str:
    """`record` for a model just logged (a ModelInfo): its files where the store keeps them."""
    return record(client, run_id, info.model_uri, client.get_logged_model(info.model_id).artifact_location)


def record_lineage(client: Any, run_id: str, source: str, name: str) -> None:
    """The SHA-256 of the run's lineage document `name` as stored now (its final version), as the param."""
    with tempfile.TemporaryDirectory(prefix="lineage-") as work:
        digest = sha256_file(Path(client.download_artifacts(run_id, name, work)))
    client.log_param(run_id, LINEAGE_PARAM.format(model_key(source)), digest)


def _params(client: Any, run_id: str, what: str) -> dict[str, str]:
    from mlflow.exceptions import MlflowException

    try:
        return dict(client.get_run(run_id).data.params)
    except MlflowException as err:
        raise ManifestMismatch(f"{what}: its run {run_id} cannot be read ({err.error_code}), so neither can "
                               "the manifest it was registered with; refusing to load it") from None


def _unrecorded(what: str) -> None:
    text = (f"{what} was registered without a manifest (before manifests existed, or not by "
            "tasks.register): its files cannot be checked")
    if os.environ.get(ALLOW_ENV) != "1":
        raise ManifestMismatch(f"{text}; refusing to load it: register it again with `python -m tasks.register`, "
                               f"or set {ALLOW_ENV}=1 to load it unchecked")
    log.warning("%s; loading it unchecked (%s=1)", text, ALLOW_ENV)


def expected(client: Any, run_id: str | None, source: str, what: str) -> dict[str, str] | None:
    """The registered {file: SHA-256} of the model `source` logged in run `run_id`, read from the
    manifest artifact and checked against the param; None when it was registered without one."""
    key = model_key(source)
    digest = _params(client, run_id, what).get(MANIFEST_PARAM.format(key)) if run_id else None
    if digest is None:
        _unrecorded(what)
        return None
    name = f"{MANIFEST_DIR}/{key}.json"
    try:  # within MANIFEST_MAX_BYTES, refused from its listed size before the download
        data = fetch_capped(client, run_id, name, MANIFEST_MAX_BYTES, what)
    except TooLarge as err:
        raise ManifestMismatch(f"{err}; refusing to load it") from None
    except Exception as err:
        raise ManifestMismatch(f"{what}: its manifest {name} in run {run_id} cannot be read ({err}); "
                               "refusing to load it") from None
    if hashlib.sha256(data).hexdigest() != digest:
        raise ManifestMismatch(
            f"{what}: its manifest {name} in run {run_id} was rewritten after registration (its SHA-256 is "
            f"not the param {MANIFEST_PARAM.format(key)}={digest[:12]}...); refusing to load it. {_FIX}")
    doc = json.loads(data)
    if doc.get("source") != source:
        raise ManifestMismatch(f"{what}: its manifest {name} describes {doc.get('source')}, not {source}")
    return dict(doc["files"])


_FIX = ("The store's copy was changed after registration: restore the file from the pipeline's outputs "
        "(`dvc pull`) and register again (`python -m tasks.register`), or move the alias back to a version "
        "that loads")


def compare(files: dict[str, str], local: Path, subpath: str, what: str) -> None:
    """Refuse when `local` (the download of artifact `subpath` of the model; "" for all of it)
    holds a file that is changed, missing or not registered, naming the first few."""
    sub = subpath.strip("/").removeprefix("./") if subpath not in ("", ".") else ""
    if Path(local).is_file():
        found = {sub: sha256_file(Path(local))}
        wanted = {sub: files[sub]} if sub in files else {}
    else:
        prefix = f"{sub}/" if sub else ""
        found = {prefix + k: v for k, v in digest_tree(Path(local)).items()}
        wanted = {k: v for k, v in files.items() if k.startswith(prefix)}
    problems = [f"{k} differs from the registered file (sha256 {wanted[k][:12]}... registered, {v[:12]}... now)"
                for k, v in sorted(found.items()) if k in wanted and wanted[k] != v]
    problems += [f"{k} is missing" for k in sorted(set(wanted) - set(found))]
    problems += [f"{k} was not registered (added after registration)" for k in sorted(set(found) - set(wanted))]
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ManifestMismatch(f"{what}: refusing to load it: {'; '.join(problems[:3])}{more}. {_FIX}")


def check_lineage(client: Any, version: Any, path: Path) -> str:
    """"" when the lineage document at `path` (downloaded from `version`'s run) is the one
    registered, or registered without a digest; else why not, naming the file."""
    key = LINEAGE_PARAM.format(model_key(version.source))
    digest = _params(client, version.run_id, f"{version.name} v{version.version}").get(key)
    if digest is None or sha256_file(Path(path)) == digest:
        return ""
    return (f"its lineage document (lineage.json in run {version.run_id}) was rewritten after registration "
            f"(its SHA-256 is not the param {key})")
