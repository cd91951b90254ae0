"""Ingest: stream every source's inputs through the checks; keep good images, say why for the rest.

Pure work on folders: no MLflow here (the CLI in __main__ logs), so tests call `ingest` directly.

How it runs: the sources yield items in a fixed order; pixel work (read, hash, decode, resize,
encode) goes to worker processes in small batches with a bounded number in flight; results come
back in input order, and the main process makes every decision that depends on other images
(duplicates), so the output is the same whatever the number of workers or the cache state.
Rows are written as they are decided: memory does not grow with the dataset, apart from the
duplicate indexes (a content hash and a 64-bit perceptual hash per kept image).
"""
from __future__ import annotations

import json
import logging
import multiprocessing
import os
import re
import shutil
from collections import Counter, deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from itertools import chain, islice
from pathlib import Path
from typing import IO, Any

from PIL import Image
from tqdm import tqdm

from tasks.common.errors import UserError
from tasks.ingest import annotate, captions, references
from tasks.ingest.cache import close_store, fingerprint, open_store
from tasks.ingest.checks import REASONS, Limits, Reject
from tasks.ingest.clip_sources import iter_clips
from tasks.ingest.clips import WORK
from tasks.ingest.config import ClipsSource, FolderSource, HubSource, ImageFolderSource, IngestConfig, label
from tasks.ingest.dedup import ExactIndex, NearIndex
from tasks.ingest.hub import iter_hub
from tasks.ingest.masks import MASK_SOURCES
from tasks.ingest.metadata import iter_metadata_json
from tasks.ingest.sources import Item, iter_folder, iter_imagefolder, source_root
from tasks.ingest.video import ClipSpec
from tasks.ingest.work import Outcome, Settings, init_worker, run_batch, run_task

log = logging.getLogger(__name__)

METADATA = "metadata.jsonl"  # the Hugging Face imagefolder metadata file
MASKS = "masks"  # processed masks: <out>/masks/<stem of the image's file_name>.png
CLIPS = "clips"  # kept clips: <out>/clips/<stem>-<sha12>/0000.png, 0001.png, ... (one folder per clip)
CLIPS_METADATA = "clips.jsonl"  # one row per kept clip (tasks/ingest/README.md, "Video clips")
CAPTION_SOURCES = ("file", "instance_prompt", "folder_name", "metadata", "tags", "hub", "fallback", "captioner")
MAX_SAMPLES = 16  # kept images shown in the preview grid
BATCH = 8  # inputs per worker call
IN_FLIGHT = 4  # batches queued per worker: enough to keep workers busy, little memory
POOL_MIN_ITEMS = 32  # fewer inputs run in this process: starting workers costs about a second


@dataclass
class Summary:
    """What one ingest run did: counts (by reason, by source) and a few preview samples."""

    total: int = 0
    kept: int = 0
    by_reason: Counter = field(default_factory=Counter)
    by_source: dict[str, Counter] = field(default_factory=dict)
    captions_from_fallback: int = 0
    captions_truncated: int = 0
    cache_hits: int = 0
    masks: Counter = field(default_factory=Counter)  # kept images with a mask, per mask_source
    references: Counter = field(default_factory=Counter)  # kept targets with references, and their files
    samples: list[Image.Image] = field(default_factory=list)
    by_concept: Counter = field(default_factory=Counter)  # kept images per concept (rows naming one)
    captions_by_source: Counter = field(default_factory=Counter)
    annotations: dict[str, dict[str, int]] = field(default_factory=dict)  # captioner, masker
    clip_inputs: int = 0  # inputs of clips sources (clip files and frame folders)
    clips_by_bucket: Counter = field(default_factory=Counter)  # kept clips per "<width>x<height>x<frames>"

    @property
    def rejected(self) -> int:
        return sum(self.by_reason.values())

    def report(self) -> dict[str, Any]:
        """reports/ingest.json: counts (DVC metrics); every reason is listed, zeros included."""
        return {
            "total": self.total,
            "kept": self.kept,
            "rejected": self.rejected,
            "rejected_by_reason": {reason: self.by_reason[reason] for reason in REASONS},
            "captions_from_fallback": self.captions_from_fallback,
            "captions_truncated": self.captions_truncated,
            "by_source": {k: dict(v) for k, v in self.by_source.items()},
            **({"by_concept": dict(sorted(self.by_concept.items()))} if self.by_concept else {}),
            "masks_by_source": {source: self.masks[source] for source in MASK_SOURCES},
            "references": {"targets": self.references["targets"], "files": self.references["files"]},
            "captions_by_source": {k: self.captions_by_source[k] for k in CAPTION_SOURCES},
            "annotations": self.annotations,
            **({"clips": {"inputs": self.clip_inputs, "kept": sum(self.clips_by_bucket.values()),
                          "by_bucket": dict(sorted(self.clips_by_bucket.items()))}} if self.clip_inputs else {}),
        }


def settings_of(cfg: IngestConfig) -> Settings:
    return Settings(
        limits=Limits(cfg.min_side, cfg.max_pixels, cfg.max_aspect_ratio),
        output_size=cfg.output_size,
        resolution=cfg.resolution,
        center_crop=cfg.center_crop,
        background=tuple(cfg.background),
        output_format=cfg.output_format,
        jpeg_quality=cfg.jpeg_quality,
        alpha_mask=cfg.alpha_mask,
        invert_mask=cfg.invert_mask,
        mask_min_value=cfg.mask_min_value,
    )


def clip_spec(cfg: IngestConfig) -> ClipSpec:
    """What a clip must be and becomes: ingest.video, with ingest's min_side and max_aspect_ratio."""
    v = cfg.video
    return ClipSpec(frames=v.frames, fps=v.fps, resolution=v.resolution, bucket_step=v.bucket_step,
                    max_seconds=v.max_seconds, max_pixels=v.max_pixels, max_bytes=v.max_bytes,
                    min_side=cfg.min_side, max_aspect_ratio=cfg.max_aspect_ratio,
                    decode_seconds=v.decode_seconds, decode_memory_mb=v.decode_memory_mb)


def check_sources(cfg: IngestConfig) -> None:
    """Fail fast (before an MLflow run is opened) when a local source folder is missing."""
    for i, src in enumerate(cfg.sources):
        if not isinstance(src, HubSource):
            key = "ingest.data_dir" if src.path == cfg.data_dir else f"ingest.sources.{i}.path"
            source_root(src.path, key)


def iter_items(cfg: IngestConfig) -> Iterator[Item]:
    """Every input of every source, sources in params order."""
    for i, src in enumerate(cfg.sources):
        key, name = f"ingest.sources.{i}", label(src)
        if isinstance(src, FolderSource):
            items = iter_folder(src, name, key)
        elif isinstance(src, ImageFolderSource):
            items = iter_imagefolder(src, name, key)
        elif isinstance(src, HubSource):
            items = iter_hub(src, name, key)
        elif isinstance(src, ClipsSource):
            items = iter_clips(src, name, key)
        else:
            items = iter_metadata_json(src, name, key)
        for item in items:
            if item.concept is None:  # a kohya folder's concept, else the source's
                item.concept, item.repeats = src.concept, src.repeats
            yield item


def worker_count(cfg: IngestConfig) -> int:
    return cfg.workers or len(os.sched_getaffinity(0))


def ingest(cfg: IngestConfig, out_dir: Path, rejected_path: Path) -> Summary:
    """Process every input into `out_dir` (images + metadata.jsonl) and `rejected_path` (JSONL)."""
    settings = settings_of(cfg)
    if any(isinstance(src, ClipsSource) for src in cfg.sources):  # samples land in the output being built
        settings = replace(settings, clips=(clip_spec(cfg), str(out_dir / WORK)))
    post = annotate.prepare(cfg)  # models resolved and loaded first: offline fails before any work
    store = open_store(cfg.cache_dir, fingerprint(settings.pixel_params()), out_dir)
    summary = Summary()
    workers = worker_count(cfg)
    log.info("ingesting %d source(s), up to %d worker process(es)", len(cfg.sources), workers)
    try:
        with open(out_dir / METADATA, "w", encoding="utf-8") as meta, open(
            rejected_path, "w", encoding="utf-8"
        ) as rejected:
            judge = _Judge(cfg, out_dir, store, summary, meta, rejected)
            results = run_ordered(iter_items(cfg), settings, store, workers)
            for item, outcome in tqdm(results, desc="ingest", unit="file", disable=None):
                judge(item, outcome)
            judge.close()
    finally:
        close_store(store)
        shutil.rmtree(out_dir / WORK, ignore_errors=True)  # samples of clips not kept
    if summary.kept + summary.rejected != summary.total:
        raise RuntimeError("ingest bug: an input was neither kept nor rejected")
    post.run(out_dir / METADATA, out_dir)  # captions and masks for the rows that lack them
    annotate.finish(post, summary)
    return summary


def run_ordered(
    items: Iterable[Item], settings: Settings, store: Any, workers: int
) -> Iterator[tuple[Item, Outcome | None]]:
    """(item, outcome) in input order; outcome is None for items rejected before reading.

    One worker (or a handful of inputs) runs in this process. More use a process pool fed
    through a bounded window of batches, so a 100k-image source is never queued at once.
    Workers come from a fork server (not a fork of this process, which may hold threads
    and locks from MLflow or tqdm) that has the pixel code imported once.
    """
    it = iter(items)
    head = list(islice(it, POOL_MIN_ITEMS))
    if workers <= 1 or len(head) < POOL_MIN_ITEMS:
        for item in chain(head, it):
            yield item, None if item.task is None else run_task(item.task, settings, store)
        return
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["tasks.ingest.core", "imagehash", "scipy.fftpack"])
    with ctx.Pool(workers, initializer=init_worker, initargs=(settings, store)) as pool:
        pending: deque = deque()
        it = chain(head, it)
        while chunk := list(islice(it, BATCH)):
            tasks = [item.task for item in chunk if item.task is not None]
            pending.append((chunk, pool.apply_async(run_batch, (tasks,)) if tasks else None))
            while len(pending) > workers * IN_FLIGHT:
                yield from _drain(*pending.popleft())
        while pending:
            yield from _drain(*pending.popleft())


def _drain(chunk: list[Item], result: Any) -> Iterator[tuple[Item, Outcome | None]]:
    outcomes = iter(result.get() if result is not None else ())
    for item in chunk:
        yield item, None if item.task is None else next(outcomes)


def output_name(rel: str, sha256: str, ext: str) -> str:
    """`<stem>-<hash prefix><ext>`: readable, and unique even when stems repeat across folders."""
    stem = re.sub(r"[^A-Za-z0-9_-]+", "_", Path(rel).stem).strip("_")[:48] or "image"
    return f"{stem}-{sha256[:12]}{ext}"


def _write(fh: IO[str], row: dict[str, Any]) -> None:
    fh.write(json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n")


class _Judge:
    """The main process's decisions, input by input: caption policy, duplicates, keep or reject."""

    def __init__(self, cfg: IngestConfig, out_dir: Path, store: Any, summary: Summary,
                 meta: IO[str], rejected: IO[str]) -> None:
        self.cfg, self.out_dir, self.store, self.summary = cfg, out_dir, store, summary
        self.meta, self.rejected = meta, rejected
        self.clips: IO[str] | None = None  # clips.jsonl, opened with the first kept clip
        self.exact = ExactIndex()
        distance = cfg.near_duplicate_distance
        self.near = NearIndex(distance) if distance is not None else None

    def __call__(self, item: Item, outcome: Outcome | None) -> None:
        s = self.summary
        s.total += 1
        counts = s.by_source.setdefault(item.source, Counter(total=0, kept=0))
        counts["total"] += 1
        s.clip_inputs += item.task is not None and item.task.clip
        if outcome is not None and outcome.cached:
            s.cache_hits += 1
        name = f"{item.source}/{item.rel}"
        try:
            caption = self._check(item, outcome)
        except Reject as err:
            row = {"source": item.source, "path": item.rel, "reason": err.reason,
                   "detail": err.detail, **item.extra, **err.extra}
            _write(self.rejected, row)
            s.by_reason[err.reason] += 1
            log.debug("rejected %s: %s", name, err)
            return
        assert outcome is not None and outcome.sha is not None
        if outcome.entry.get("kind") == "clip":
            self._keep_clip(item, outcome, caption, name)
        else:
            self._keep(item, outcome, caption, name)
        counts["kept"] += 1

    def _check(self, item: Item, outcome: Outcome | None) -> captions.Caption:
        if item.reject is not None:
            raise item.reject
        assert outcome is not None
        if outcome.reject is not None:
            raise outcome.reject
        if item.text is not None:
            text, how = item.text, item.caption_source
        else:
            text, how = outcome.caption, "file"
        if not (text or "").strip() and item.concept_caption:  # kohya: the folder's class tokens
            text, how = item.concept_caption, "folder_name"
        caption = captions.decide(text, how, item.tags, item.tag_separator, self.cfg.captions)
        first = self.exact.find(outcome.sha)
        if first is not None:
            raise Reject("duplicate", f"same bytes as {first}", duplicate_of=first)
        if self.near is not None and "phash" in outcome.entry:  # clips: exact duplicates only
            hit = self.near.find(int(outcome.entry["phash"], 16))
            if hit is not None:
                other, distance = hit
                detail = f"perceptual hash {distance} bit(s) from {other}"
                raise Reject("near_duplicate", detail, duplicate_of=other, distance=distance)
        return caption

    def _keep(self, item: Item, outcome: Outcome, caption: captions.Caption, name: str) -> None:
        entry, sha = outcome.entry, outcome.sha
        file_name = output_name(item.extra.get("image", item.rel), sha, entry["ext"])
        key = outcome.key or sha
        self.store.materialize(key, entry["ext"], self.out_dir / file_name)
        mask_source = entry.get("mask_source")
        mask_file_name = f"{MASKS}/{Path(file_name).stem}.png" if mask_source else None
        if mask_file_name:
            (self.out_dir / MASKS).mkdir(exist_ok=True)
            self.store.materialize(key, entry["ext"], self.out_dir / mask_file_name, mask=True)
        reference_file_names = self._references(key, entry, Path(file_name).stem)
        image_in_metadata = "image" in item.extra
        row = {
            "file_name": file_name,
            "text": caption.text,
            "tags": caption.tags,
            "tag_separator": item.tag_separator,
            "score": None if item.score is None else float(item.score),
            "caption_source": caption.source,
            "caption_truncated": caption.truncated,
            "source": item.source,
            "path": item.extra["image"] if image_in_metadata else item.rel,
            "metadata_file": item.rel if image_in_metadata else None,
            "sha256": sha,
            "phash": entry["phash"],
            **{k: entry[k] for k in ("width", "height", "source_width", "source_height")},
            "concept": item.concept,
            "repeats": item.repeats,
            "mask_file_name": mask_file_name,
            "mask_source": mask_source,
            "reference_file_names": reference_file_names,
        }
        _write(self.meta, row)
        self.exact.add(sha, name)
        if self.near is not None:
            self.near.add(int(entry["phash"], 16), name)
        s = self.summary
        s.kept += 1
        if item.concept is not None:
            s.by_concept[item.concept] += 1
        s.captions_from_fallback += caption.source == "fallback"
        s.captions_truncated += caption.truncated
        if mask_source:
            s.masks[mask_source] += 1
        if reference_file_names:
            s.references["targets"] += 1
            s.references["files"] += len(reference_file_names)
        s.captions_by_source[caption.source] += 1
        if len(s.samples) < MAX_SAMPLES:
            with Image.open(self.out_dir / file_name) as im:
                factor = max(1, max(im.size) // 256)  # a cheap box reduction for the preview
                s.samples.append(im.convert("RGB").reduce(factor))


    def _keep_clip(self, item: Item, outcome: Outcome, caption: captions.Caption, name: str) -> None:
        """Move a kept clip's samples into clips/<stem>-<sha12>/ and write its row to clips.jsonl."""
        entry, sha = outcome.entry, outcome.sha
        assert sha is not None
        folder = f"{CLIPS}/{output_name(item.rel, sha, '')}"
        (self.out_dir / CLIPS).mkdir(exist_ok=True)
        Path(entry["work"]).replace(self.out_dir / folder)
        if self.clips is None:
            self.clips = open(self.out_dir / CLIPS_METADATA, "w", encoding="utf-8")  # noqa: SIM115 (closed by close)
        bucket = f"{entry['width']}x{entry['height']}x{entry['frames']}"
        row = {
            "file_name": folder,
            "frame_files": [f"{i:04d}.png" for i in range(entry["frames"])],
            "text": caption.text,
            "caption_source": caption.source,
            "caption_truncated": caption.truncated,
            "source": item.source,
            "path": item.rel,
            "sha256": sha,
            "bucket": bucket,
            **{k: entry[k] for k in ("frames", "fps", "width", "height", "source_width", "source_height",
                                     "source_fps", "source_frames", "source_seconds", "codec", "container")},
            "concept": item.concept,
            "repeats": item.repeats,
        }
        _write(self.clips, row)
        self.exact.add(sha, name)
        s = self.summary
        s.kept += 1
        s.clips_by_bucket[bucket] += 1
        if item.concept is not None:
            s.by_concept[item.concept] += 1
        s.captions_from_fallback += caption.source == "fallback"
        s.captions_truncated += caption.truncated
        s.captions_by_source[caption.source] += 1
        if len(s.samples) < MAX_SAMPLES:
            with Image.open(self.out_dir / folder / "0000.png") as im:
                s.samples.append(im.convert("RGB"))

    def close(self) -> None:
        if self.clips is not None:
            self.clips.close()

    def _references(self, key: str, entry: dict[str, Any], stem: str) -> list[str]:
        """Copy a kept target's processed references out of the store; their names in the output."""
        names = references.output_names(stem, entry.get("references", 0)) if entry.get("references") else []
        if names:
            (self.out_dir / references.REFERENCES).mkdir(exist_ok=True)
        for i, name in enumerate(names):
            self.store.materialize(key, entry["ext"], self.out_dir / name, reference=i)
        return names


def require_kept(summary: Summary, rejected_path: Path | None = None) -> None:
    """Zero usable images is an error the user must fix, not an empty dataset to train on."""
    if summary.kept:
        return
    where = f"; reasons per file in {rejected_path}" if rejected_path else ""
    counts = {k: v for k, v in summary.by_reason.items() if v}
    if summary.clip_inputs:
        raise UserError(
            f"ingest.sources: no usable images or clips ({summary.total} inputs, rejected: {counts or 'none'}"
            f"{where}). Add mp4/webm/mov clips (or folders of frames) of at least the smallest of "
            "ingest.video.frames at ingest.video.fps, or point ingest.sources elsewhere; for the demo clips run "
            "`make data` (data/demo/clips)."
        )
    raise UserError(
        f"ingest.sources: no usable images ({summary.total} inputs, rejected: "
        f"{counts or 'none'}{where}). Add PNG/JPEG/WebP images (short side at least "
        "ingest.min_side px) or point ingest.sources elsewhere; for the demo run `make data`."
    )
