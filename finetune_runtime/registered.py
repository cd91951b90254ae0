"""What a registered version's run says about it, read within bounds and checked against its digest.

The register stage (tasks/register/manifest.py) logs, in a version's run, the manifest of the model's
files (`manifests/<model id>.json`, its SHA-256 the run param `manifest.<model id>`) and, after the
last write of the run's `lineage.json`, that document's SHA-256 as the param `lineage.<model id>`.
MLflow never lets a logged param change, so a document whose digest matches its param is the one
registered. Both are small (a few KB); anything over `LINEAGE_MAX_BYTES` or `MANIFEST_MAX_BYTES` is
refused before it is read, from the size the store lists when it lists one, else from the download,
with an error naming the cap (`TooLarge`). Used by the served model (adapter_cache.py: which adapter
versions a base export's endpoint applies) and by the stages (tasks/register/manifest.py, registry.py).
"""
from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
import tempfile
from typing import Any

MANIFEST_PARAM = "manifest.{}"
LINEAGE_PARAM = "lineage.{}"
LINEAGE_ARTIFACT = "lineage.json"
#: The most bytes a version's lineage document or manifest may have to be read at all.
LINEAGE_MAX_BYTES = 1 << 20  # 1 MiB: the demo's is 2 KB
MANIFEST_MAX_BYTES = 8 << 20  # 8 MiB: about 60,000 files' digests


class TooLarge(ValueError):
    """An artifact over the bytes it may have to be read (names the file and the cap)."""


def model_key(source: str) -> str:
    """The params' suffix for a model: its logged-model id (`models:/m-...`), else a digest of its source."""
    match = re.fullmatch(r"models:/(m-[0-9a-f]+)/?", source or "")
    return match.group(1) if match else "src-" + hashlib.sha256(source.encode()).hexdigest()[:32]


def fetch_capped(client: Any, run_id: str, path: str, cap: int, what: str) -> bytes:
    """The bytes of artifact `path` of run `run_id`: FileNotFoundError when the run does not hold it,
    TooLarge (naming `cap`) when the store lists it, or it downloads, over `cap` bytes."""
    folder, name = posixpath.split(path)
    listed = {posixpath.basename(f.path): f for f in client.list_artifacts(run_id, folder or None)}
    entry = listed.get(name)
    if entry is None or entry.is_dir:
        raise FileNotFoundError(f"{what}: {path} is not in run {run_id}")
    if entry.file_size is not None and int(entry.file_size) > cap:
        raise TooLarge(_too_large(what, path, int(entry.file_size), cap))
    with tempfile.TemporaryDirectory(prefix="capped-") as work:
        local = client.download_artifacts(run_id, path, work)
        size = os.path.getsize(local)
        if size > cap:
            raise TooLarge(_too_large(what, path, size, cap))
        with open(local, "rb") as fh:
            return fh.read(cap + 1)


def _too_large(what: str, path: str, size: int, cap: int) -> str:
    return (f"{what}: {path} is {size} bytes, over the {cap} bytes such a file may have "
            "(finetune_runtime/registered.py); refusing to read it")


def verified_lineage(client: Any, version: Any, what: str) -> dict[str, Any]:
    """The lineage document of registered `version` (a ModelVersion), read within LINEAGE_MAX_BYTES from
    its own run and checked against the run's param `lineage.<model id>`, and naming this version
    (its `model` section's source; its name when recorded). A ValueError says why not."""
    run_id = getattr(version, "run_id", None)
    if not run_id:
        raise ValueError(f"{what} was registered without a run, so without a lineage document")
    key = LINEAGE_PARAM.format(model_key(version.source))
    digest = dict(client.get_run(run_id).data.params).get(key)
    if digest is None:
        raise ValueError(f"{what} has no recorded digest of its lineage document (run param {key}), so its "
                         "lineage cannot be checked: register it again")
    try:
        data = fetch_capped(client, run_id, LINEAGE_ARTIFACT, LINEAGE_MAX_BYTES, what)
    except FileNotFoundError:
        raise ValueError(f"{what} has no lineage document ({LINEAGE_ARTIFACT} in run {run_id})") from None
    if hashlib.sha256(data).hexdigest() != digest:
        raise ValueError(f"{what}: its lineage document ({LINEAGE_ARTIFACT} in run {run_id}) was rewritten "
                         f"after registration (its SHA-256 is not the run param {key})")
    try:
        doc = json.loads(data)
    except ValueError:
        doc = None
    owner = doc.get("model") if isinstance(doc, dict) else None
    if not isinstance(owner, dict) or owner.get("source") != version.source or (
            "name" in owner and owner["name"] != version.name):
        raise ValueError(f"{what}: its lineage document ({LINEAGE_ARTIFACT} in run {run_id}) does not describe "
                         "this version")
    return doc
