"""The registered adapters a base export's endpoint applies: looked up, checked, downloaded into one
folder bounded in bytes, deleted on eviction.

genai_serving.AdapterServer calls `AdapterCache.get` inside the
model's turn (limits.Turns), so a look-up, a download and the compile after it wait in the
same bounded queue and under the same deadline as a generation.

- Which versions apply: only versions of the registered models the endpoint was registered to
  apply (model_config `adapter_models`: by default the one model the pipeline registers this base's
  fine-tunes under, `<model>` of `<model>-base`; params.yaml `register.serve_adapter_models`), checked
  before anything is looked up; a base export registered without that list applies none. Of those, a
  version applies when its lineage document (`lineage.json` in the version's own run, written by the
  register stage) is the one registered (its SHA-256 is the run's param `lineage.<model id>`, which
  MLflow never lets change), describes this version (`model.source`, `model.name`) and names the
  base export it was trained for (`base_export.key`): registered.py, `verified_lineage`. Tags are
  editable by anyone allowed to tag, so no tag decides it.
- What is read: the lineage document at most `registered.LINEAGE_MAX_BYTES`, refused from its listed
  size before it is downloaded; the adapter artifact's size is summed from the store's listing
  (every file's size known, at most `MAX_LISTED` entries and `MAX_DEPTH` folders deep) and checked
  against the cache's bytes before anything is downloaded, then again on disk after.
- Where files live: one folder per serving process, `<temp dir>/sd-pyfunc-adapters/<pid>` (TMPDIR
  moves it), holding at most `max_bytes` (model_config `adapter_cache_mb`) and `max_adapters`
  versions; the least recently used version's folder is deleted to make room. A process holds an
  exclusive lock on its folder's marker while it runs; at start it deletes the folders (with the
  marker) whose process is gone, so a killed worker's downloads do not outlive it.
- What is opened: `runtime_adapter.json`'s `file` must be a relative path inside the version's
  `adapter` artifact; an absolute path or one that leaves the folder is refused, naming the field.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from finetune_runtime import layout, registered

log = logging.getLogger("sd_pyfunc.adapters")

#: The registered adapter version's artifact (genai_lora.safetensors, runtime_adapter.json, ...).
ADAPTER_ARTIFACT = layout.ADAPTER
ADAPTER_INFO = "runtime_adapter.json"
#: A folder the cache made (and so may delete) carries this file.
MARKER = ".sd-adapter-cache"
MAX_ADAPTERS = 8  # the compiled pipeline covers every cached adapter's layers: bounds a recompile
#: model_config key: the registered models whose versions a base export's endpoint applies.
ADAPTER_MODELS = "adapter_models"
#: An adapter artifact's listing: at most this many entries, folders at most this deep.
MAX_LISTED, MAX_DEPTH = 64, 4
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def allowed_models(model_config: dict[str, Any] | None) -> tuple[str, ...] | None:
    """model_config `adapter_models` (None: not recorded); a ValueError naming the key when malformed."""
    value = (model_config or {}).get(ADAPTER_MODELS)
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and _NAME.match(v) for v in value):
        raise ValueError(f"model_config {ADAPTER_MODELS}: {value!r} is not a list of registered model names")
    return tuple(value)


def confined_file(folder: str, info: dict[str, Any], where: str) -> str:
    """The adapter file `info["file"]` names, inside `folder`; a ValueError naming the field otherwise."""
    name = info.get("file") if isinstance(info, dict) else None
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: {ADAPTER_INFO} has no `file` (a relative path of the adapter file)")
    if os.path.isabs(name):
        raise ValueError(f"{where}: {ADAPTER_INFO} `file` {name!r} is an absolute path; only a file inside "
                         "the version's adapter artifact may be named (a relative path)")
    root = os.path.realpath(folder)
    path = os.path.realpath(os.path.join(root, name))
    if os.path.commonpath([root, path]) != root or path == root:
        raise ValueError(f"{where}: {ADAPTER_INFO} `file` {name!r} leaves the version's adapter artifact; "
                         "only a file inside it may be named")
    if not os.path.isfile(path):
        raise ValueError(f"{where}: {ADAPTER_INFO} `file` {name!r} is not a file of the version's adapter artifact")
    return path


def adapter_file(folder: str, where: str) -> str:
    """The GenAI LoRA file of a downloaded `adapter` artifact, confined to it."""
    with open(os.path.join(folder, ADAPTER_INFO)) as fh:
        return confined_file(folder, json.load(fh), where)


def folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)


def trained_for(client: Any, mv: Any, base_key: str, ref: str) -> None:
    """A ValueError unless `mv`'s lineage document is the one registered (registered.verified_lineage,
    read within its cap) and says it was trained for base export `base_key`."""
    from mlflow.exceptions import MlflowException

    what = f"adapter: {ref} (version {mv.version})"
    try:
        doc = registered.verified_lineage(client, mv, what)
    except (MlflowException, OSError) as err:  # the store could not give it: the same answer as absent
        raise ValueError(f"{what}: its lineage document cannot be read ({type(err).__name__}), so nothing "
                         "says which base export it was trained for") from None
    theirs = (doc.get("base_export") or {}).get("key")
    if theirs != base_key:
        raise ValueError(f"adapter: {ref} (version {mv.version}) was not registered for this base export (its "
                         f"lineage document names base export {str(theirs)[:12] if theirs else 'none'}, this "
                         f"endpoint serves {base_key[:12]}): serve it from its own base's endpoint")


@dataclass
class Entry:
    """One downloaded version: its folder, its confined adapter file, bytes on disk, the loaded
    handle (the caller's, e.g. GenAI's Adapter)."""

    folder: str
    file: str
    size: int
    handle: Any = None


def _owner_gone(folder: str) -> bool:
    """Whether no process holds the lock on `folder`'s marker (its serving process is gone)."""
    import fcntl

    try:
        fd = os.open(os.path.join(folder, MARKER), os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def clean_stale(root: str) -> list[str]:
    """Delete the cache folders under `root` (those with the marker) whose process is gone."""
    removed = []
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        folder = os.path.join(root, name)
        if os.path.isdir(folder) and not os.path.islink(folder) and _owner_gone(folder):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    if removed:
        log.info("removed %d adapter cache folder(s) of stopped processes under %s", len(removed), root)
    return removed


def _mb(size: float) -> str:
    return f"{size / 2**20:.3g}"


class AdapterCache:
    """Registered adapter versions for base export `base_key`, downloaded into one folder of at
    most `max_bytes` and `max_adapters` versions, least recently used deleted first."""

    def __init__(self, base_key: str, max_bytes: int, allowed: tuple[str, ...] | None = None, root: str | None = None,
                 max_adapters: int = MAX_ADAPTERS) -> None:
        """`allowed`: the registered models whose versions apply (model_config `adapter_models`; None: none)."""
        import atexit
        import fcntl

        self.base_key, self.max_bytes, self.max_adapters = base_key, int(max_bytes), max_adapters
        self.allowed = allowed
        self.root = root or os.path.join(tempfile.gettempdir(), "sd-pyfunc-adapters")
        os.makedirs(self.root, exist_ok=True)
        clean_stale(self.root)
        self.folder = tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=self.root)
        # locked before it takes the marker's name, so no other process ever sees it unlocked
        self._lock = os.open(os.path.join(self.folder, MARKER + ".new"), os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        os.rename(os.path.join(self.folder, MARKER + ".new"), os.path.join(self.folder, MARKER))
        self.entries: OrderedDict[str, Entry] = OrderedDict()  # "name/version" -> Entry, oldest first
        self._downloads = 0
        atexit.register(self.close)

    @property
    def used(self) -> int:
        return sum(entry.size for entry in self.entries.values())

    def close(self) -> None:
        """Delete the cache folder (also done at the next start of any serving process)."""
        self.entries.clear()
        shutil.rmtree(self.folder, ignore_errors=True)

    def get(self, name: str, alias: str | None, version: str | None, check: Callable[[str], None],
            keep: frozenset[str] = frozenset()) -> tuple[str, Entry, bool]:
        """("name/version", its Entry, whether it was downloaded now). `check(what)` is called before
        each step that may take time (raises past the request's deadline); `keep`: versions the
        same request uses, never evicted for this one. A ValueError names what is wrong."""
        import mlflow

        ref = f"{name}@{alias}" if alias else f"{name}/{version}"
        self._allowed(name, ref)
        check(f"looking up adapter {ref}")
        client = mlflow.MlflowClient()
        mv = _lookup(client, name, alias, version, ref)
        key = f"{name}/{mv.version}"
        if key in self.entries:
            self.entries.move_to_end(key)
            return key, self.entries[key], False
        check(f"reading the lineage of adapter {key}")
        trained_for(client, mv, self.base_key, ref)
        uri = f"models:/{key}/artifacts/{ADAPTER_ARTIFACT}"
        self._make_room(_listed_bytes(uri, ref), keep, ref)  # before any download
        check(f"downloading adapter {key}")
        self.entries[key] = self._download(uri, ref, keep)
        return key, self.entries[key], True

    def _allowed(self, name: str, ref: str) -> None:
        """A ValueError naming the field unless `name` is one of the models this endpoint applies."""
        if self.allowed is None:
            raise ValueError(f"adapter: {ref}: this base export was registered without the list of the models "
                             f"whose adapters it applies (model_config {ADAPTER_MODELS}), so it applies none: "
                             f"register it again, or load it with model_config {ADAPTER_MODELS}")
        if name not in self.allowed:
            raise ValueError(f"adapter: {ref}: registered model {name!r} is not one whose versions this endpoint "
                             f"applies ({', '.join(self.allowed) or 'none'}; model_config {ADAPTER_MODELS}, "
                             "params.yaml register.serve_adapter_models)")

    def evict(self, key: str) -> None:
        entry = self.entries.pop(key)
        shutil.rmtree(entry.folder, ignore_errors=True)
        log.info("evicted adapter %s from the cache (%s MB freed)", key, _mb(entry.size))

    def _make_room(self, size: int, keep: frozenset[str], ref: str) -> None:
        if size > self.max_bytes:
            raise ValueError(f"adapter: {ref} is {_mb(size)} MB, more than this endpoint's adapter cache holds "
                             f"({_mb(self.max_bytes)} MB, model_config adapter_cache_mb): raise adapter_cache_mb")
        while self.entries and (self.used + size > self.max_bytes or len(self.entries) >= self.max_adapters):
            victim = next((key for key in self.entries if key not in keep), None)
            if victim is None:
                raise ValueError(f"adapter: the adapters this request names do not fit this endpoint's adapter "
                                 f"cache together ({_mb(self.max_bytes)} MB, model_config adapter_cache_mb): "
                                 "blend fewer or raise adapter_cache_mb")
            self.evict(victim)

    def _download(self, uri: str, ref: str, keep: frozenset[str]) -> Entry:
        import mlflow

        self._downloads += 1
        folder = os.path.join(self.folder, f"a{self._downloads}")
        try:
            path = mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=folder)
            size = folder_bytes(folder)
            self._make_room(size, keep, ref)  # the files may be larger than the listing said
            entry = Entry(folder, adapter_file(path, f"adapter: {ref}"), size)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        log.info("downloaded adapter %s (%s MB; the cache holds %s of %s MB)", ref, _mb(size),
                 _mb(self.used + size), _mb(self.max_bytes))
        return entry


def _lookup(client: Any, name: str, alias: str | None, version: str | None, ref: str) -> Any:
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version_by_alias(name, alias) if alias else client.get_model_version(name, version)
    except MlflowException:
        raise ValueError(f"adapter: {ref} is not a registered model version here") from None


def _listed_bytes(uri: str, ref: str) -> int:
    """The bytes of an artifact folder as its store lists them, before anything is downloaded: a
    ValueError naming the field when a file's size is not listed, or the listing is over MAX_LISTED
    entries or MAX_DEPTH folders deep (what the cache cannot bound before the download)."""
    import mlflow

    total, seen, todo = 0, 0, [(uri, 0)]
    while todo:
        folder, depth = todo.pop()
        for item in mlflow.artifacts.list_artifacts(artifact_uri=folder):
            seen += 1
            if seen > MAX_LISTED:
                raise ValueError(f"adapter: {ref}: its adapter artifact lists more than {MAX_LISTED} files; "
                                 "an adapter has a few: register it again")
            if item.is_dir:
                if depth >= MAX_DEPTH:
                    raise ValueError(f"adapter: {ref}: its adapter artifact has folders more than {MAX_DEPTH} deep")
                todo.append((f"{folder}/{os.path.basename(item.path)}", depth + 1))
            elif item.file_size is None:
                raise ValueError(f"adapter: {ref}: the store does not list the size of {item.path}, so it cannot "
                                 "be checked against the adapter cache before the download")
            else:
                total += int(item.file_size)
    return total
