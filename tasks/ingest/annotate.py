"""Models run over the kept images after ingest: resolved up front, batched, cached by content.

`prepare(cfg)` runs before any image is processed: it resolves each configured model to a local
folder (building a `builtin:tiny-...` one, finding a hub snapshot in the local Hugging Face cache
or downloading it) and fails at once, naming the fix, when a hub model cannot be had offline.
`PostPass.run` then streams metadata.jsonl in chunks of rows (memory stays flat), runs each
annotator on the processed images of the rows that need it, and replaces metadata.jsonl.

Results are cached under `<ingest.cache_dir>/annotations/` (a folder carrying the project's
marker, beside the ingest cache's own parameter sets, which pruning never confuses it with), by
SHA-256 over the processed image's bytes, the model (id + revision, or folder and its files'
times), and the settings that change the model's output.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any, Protocol

from PIL import Image

from tasks.common import safe_remove
from tasks.common.errors import UserError
from tasks.ingest.annotate_config import is_hub_id
from tasks.ingest.cache import _write_atomic
from tasks.ingest.tiny_annotators import BUILDERS

log = logging.getLogger(__name__)

KIND = "ingest-annotations"
ROWS_PER_CHUNK = 256  # metadata rows held at once
_WEIGHTS = (["*.safetensors"], ["pytorch_model.bin"])  # safetensors first; .bin read weights_only


@dataclass
class Resolved:
    """A model's local folder and the identity its cache entries are keyed by."""

    folder: Path
    identity: str


def resolve(model: str, revision: str | None, key: str, workdir: Path) -> Resolved:
    """builtin -> built into workdir; local folder -> itself; hub id -> a pinned snapshot."""
    if model.startswith("builtin:"):
        if model not in BUILDERS:
            raise UserError(f"{key}: unknown built-in {model!r}; choose one of {', '.join(BUILDERS)}")
        return Resolved(BUILDERS[model](workdir / model.split(":", 1)[1]), model)
    if is_hub_id(model):
        return Resolved(_snapshot(model, str(revision), key), f"{model}@{revision}")
    local = Path(model).expanduser()
    if not (local / "config.json").is_file():
        raise UserError(
            f"{key}: {model!r} is neither a built-in (builtin:tiny-...), a hub id (org/name) nor "
            "a folder saved with save_pretrained (no config.json there)"
        )
    stamps = sorted((p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in local.iterdir() if p.is_file())
    return Resolved(local, f"{local.resolve()}:{hashlib.sha256(repr(stamps).encode()).hexdigest()[:16]}")


def _snapshot(repo_id: str, revision: str, key: str) -> Path:
    """The snapshot folder: from the local HF cache if there, else downloaded; UserError if neither."""
    from huggingface_hub import constants, snapshot_download

    fix = (
        f"On a machine with network, run `hf download {repo_id} --revision {revision}` "
        f"(fills the Hugging Face cache; copy it here or set HF_HOME to it), or download with "
        f"--local-dir DIR and set {key.rsplit('.', 1)[0]}.model: DIR"
    )
    for online in (False, True):
        if online and constants.HF_HUB_OFFLINE:
            break
        for weights in _WEIGHTS:
            try:
                path = Path(snapshot_download(
                    repo_id, revision=revision, local_files_only=not online,
                    allow_patterns=["*.json", "*.txt", "*.model", *weights],
                ))
            except Exception as err:  # offline, missing revision, network: all "cannot have it"
                if online:
                    raise UserError(f"{key}: could not download {repo_id}@{revision} "
                                    f"({type(err).__name__}: {str(err)[:200]}). {fix}") from None
                break
            if any(path.glob(weights[0])) and (path / "config.json").is_file():
                return path
    raise UserError(
        f"{key}: {repo_id}@{revision} is not in the local Hugging Face cache and this machine is "
        f"offline (HF_HUB_OFFLINE). {fix}"
    )


class Annotator(Protocol):
    """One model's work on the rows: which need it, the model call, and how a result is applied."""

    name: str
    batch_size: int
    identity: str
    outcomes: Counter  # what became of the results (captioned, empty, ...)

    def wants(self, row: dict[str, Any]) -> bool: ...
    def settings(self, row: dict[str, Any]) -> dict[str, Any]:
        """What changes the model's output for this row, besides the image and the model (the cache key)."""
    def compute(self, images: list[Image.Image], rows: list[dict[str, Any]]) -> list[bytes]: ...
    def apply(self, row: dict[str, Any], result: bytes, out_dir: Path) -> None: ...


@dataclass
class Counts:
    """Per annotator: rows it ran for, results from the cache, results the model computed."""

    by_name: dict[str, Counter] = field(default_factory=dict)

    def add(self, name: str, what: str, n: int = 1) -> None:
        self.by_name.setdefault(name, Counter(rows=0, cache_hits=0, computed=0))[what] += n

    def report(self) -> dict[str, dict[str, int]]:
        return {name: dict(c) for name, c in self.by_name.items()}


class ResultCache:
    """Model results by key under `<root>/<key[:2]>/<key>`; root None keeps nothing."""

    def __init__(self, root: Path | None) -> None:
        self.root = None if root is None else safe_remove.mark(root, KIND)

    def key(self, annotator: Annotator, digest: str, row: dict[str, Any]) -> str:
        what = {"name": annotator.name, "model": annotator.identity, "settings": annotator.settings(row)}
        return hashlib.sha256(json.dumps([what, digest], sort_keys=True).encode()).hexdigest()

    def get(self, key: str) -> bytes | None:
        if self.root is None:
            return None
        try:
            return (self.root / key[:2] / key).read_bytes()
        except OSError:
            return None

    def put(self, key: str, data: bytes) -> None:
        if self.root is not None:
            (self.root / key[:2]).mkdir(exist_ok=True)
            _write_atomic(self.root / key[:2] / key, data)


def _chunks(path: Path) -> Iterator[list[dict[str, Any]]]:
    with open(path, encoding="utf-8") as fh:
        rows = (json.loads(line) for line in fh if line.strip())
        while chunk := list(islice(rows, ROWS_PER_CHUNK)):
            yield chunk


class PostPass:
    """The annotators of one run over metadata.jsonl; `run` rewrites the file in place."""

    def __init__(self, annotators: list[Annotator], cache_root: Path | None) -> None:
        self.annotators = annotators
        self.cache = ResultCache(cache_root)
        self.counts = Counts()

    def run(self, meta: Path, out_dir: Path) -> None:
        if not self.annotators:
            return
        fd, tmp = tempfile.mkstemp(prefix=f".{meta.name}.", dir=meta.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as dst:
                for chunk in _chunks(meta):
                    self._chunk(chunk, out_dir)
                    for row in chunk:
                        dst.write(json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n")
            os.replace(tmp, meta)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def _chunk(self, rows: list[dict[str, Any]], out_dir: Path) -> None:
        digests: dict[str, str] = {}
        for ann in self.annotators:
            todo = [r for r in rows if ann.wants(r)]
            if not todo:
                continue
            self.counts.add(ann.name, "rows", len(todo))
            keys = []
            for r in todo:
                if r["file_name"] not in digests:
                    data = (out_dir / r["file_name"]).read_bytes()
                    digests[r["file_name"]] = hashlib.sha256(data).hexdigest()
                keys.append(self.cache.key(ann, digests[r["file_name"]], r))
            results = {k: got for k in keys if (got := self.cache.get(k)) is not None}
            self.counts.add(ann.name, "cache_hits", len(results))
            missing = [(r, k) for r, k in zip(todo, keys) if k not in results]
            for i in range(0, len(missing), ann.batch_size):
                batch = missing[i : i + ann.batch_size]
                images = [_open(out_dir / r["file_name"]) for r, _ in batch]
                for (_, k), result in zip(batch, ann.compute(images, [r for r, _ in batch])):
                    self.cache.put(k, result)
                    results[k] = result
                self.counts.add(ann.name, "computed", len(batch))
            for r, k in zip(todo, keys):
                ann.apply(r, results[k], out_dir)


def _open(path: Path) -> Image.Image:
    with Image.open(path) as im:
        return im.convert("RGB")


def prepare(cfg: Any) -> PostPass:
    """Resolve and load the configured models now, before any image is processed."""
    from tasks.ingest.captioner import Captioner
    from tasks.ingest.masker import Masker

    annotators: list[Annotator] = []
    with tempfile.TemporaryDirectory(prefix="annotators-") as tmp:
        if cfg.captioner is not None:
            c = cfg.captioner
            r = resolve(c.model, c.revision, "ingest.captioner.model", Path(tmp))
            annotators.append(Captioner(c, cfg.captions, r.folder, r.identity))
        if cfg.masker is not None:
            m = cfg.masker
            r = resolve(m.model, m.revision, "ingest.masker.model", Path(tmp))
            annotators.append(Masker(m, r.folder, r.identity))
    root = None if cfg.cache_dir is None or not annotators else Path(cfg.cache_dir) / "annotations"
    return PostPass(annotators, root)


def finish(post: PostPass, summary: Any) -> None:
    """Move the captioner's captions between the summary's caption counts; add the run's counts."""
    for ann in post.annotators:
        replaced = getattr(ann, "replaced", Counter())
        for source, n in replaced.items():
            summary.captions_by_source[source] -= n
            summary.captions_by_source["captioner"] += n
        summary.captions_from_fallback -= replaced.get("fallback", 0)
        post.counts.by_name.setdefault(ann.name, Counter(rows=0, cache_hits=0, computed=0))
        post.counts.by_name[ann.name].update(ann.outcomes)
        summary.masks["generated"] += ann.outcomes.get("generated", 0)  # the masker's, beside the files'
    summary.annotations = post.counts.report()
