"""Ingest: list the source's files, keep good images (normalised), reject the rest with a reason.

Pure work on folders: no MLflow here (the CLI in __main__ logs), so tests call `ingest` directly.
Images are processed one at a time and written as they are kept, so memory does not grow with the
dataset; only a few samples are held for the preview grid.
"""
from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image
from tqdm import tqdm

from tasks.common.errors import UserError
from tasks.ingest.checks import REASONS, Limits, Reject, decode, normalise, read_bytes
from tasks.ingest.config import IngestConfig
from tasks.ingest.sources import Entry, read_caption, scan_folder

log = logging.getLogger(__name__)

METADATA = "metadata.jsonl"  # the Hugging Face imagefolder metadata file
MAX_SAMPLES = 16  # kept images held for the preview grid


@dataclass
class Summary:
    """What one ingest run did: metadata rows of kept images, rejected files, preview samples."""

    total: int = 0
    kept: list[dict[str, Any]] = field(default_factory=list)
    rejected: list[dict[str, Any]] = field(default_factory=list)
    samples: list[Image.Image] = field(default_factory=list)

    def report(self) -> dict[str, Any]:
        """reports/ingest.json: counts (DVC metrics); every reason is listed, zeros included."""
        by_reason = {reason: 0 for reason in REASONS}
        for row in self.rejected:
            by_reason[row["reason"]] += 1
        return {
            "total": self.total,
            "kept": len(self.kept),
            "rejected": len(self.rejected),
            "rejected_by_reason": by_reason,
            "captions_from_fallback": sum(row["caption_source"] == "fallback" for row in self.kept),
        }


def source_root(source: Path) -> Path:
    """The resolved source folder, or a UserError that says how to get one."""
    if not source.exists():
        hint = (
            "generate the demo images with `make data` (or `python data/demo/generate.py`)"
            if source.as_posix().rstrip("/").endswith("data/demo/subject")
            else "check the path"
        )
        raise UserError(
            f"ingest.source: {source} does not exist. {hint.capitalize()}, or set ingest.source in "
            "params.yaml to a folder of images with same-named .txt captions."
        )
    if not source.is_dir():
        raise UserError(
            f"ingest.source: {source} is not a folder; set ingest.source to a folder of images."
        )
    return source.resolve()


def output_name(rel: str, sha256: str) -> str:
    """`<stem>-<hash prefix>.png`: readable, and unique even when stems repeat across folders."""
    stem = re.sub(r"[^A-Za-z0-9_-]+", "_", Path(rel).stem).strip("_")[:48] or "image"
    return f"{stem}-{sha256[:12]}.png"


def ingest(cfg: IngestConfig, out_dir: Path) -> Summary:
    """Process every file of `cfg.source` into `out_dir` (images + metadata.jsonl)."""
    root = source_root(cfg.source)
    limits = Limits(cfg.min_side, cfg.max_pixels, cfg.max_aspect_ratio)
    entries = scan_folder(root)
    summary = Summary(total=len(entries))
    kept_by_hash: dict[str, str] = {}
    log.info("ingesting %d files from %s", len(entries), root)
    # Real files before links, so that of two identical files the link is the one called duplicate.
    order = sorted(entries, key=lambda e: (e.path.is_symlink(), e.rel))
    for entry in tqdm(order, desc="ingest", unit="file", disable=None):
        try:
            row, image = _process(entry, root, cfg, limits, kept_by_hash)
        except Reject as err:
            row = {"path": entry.rel, "reason": err.reason, "detail": err.detail, **err.extra}
            summary.rejected.append(row)
            log.debug("rejected %s: %s", entry.rel, err)
            continue
        image.save(out_dir / row["file_name"], format="PNG")
        kept_by_hash[row["sha256"]] = entry.rel
        summary.kept.append(row)
        if len(summary.samples) < MAX_SAMPLES:
            summary.samples.append(image)
    if len(summary.kept) + len(summary.rejected) != summary.total:
        raise RuntimeError("ingest bug: an input file was neither kept nor rejected")
    summary.kept.sort(key=lambda row: row["source"])
    summary.rejected.sort(key=lambda row: row["path"])
    with open(out_dir / METADATA, "w", encoding="utf-8") as fh:
        for row in summary.kept:
            fh.write(json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n")
    return summary


def _process(
    entry: Entry, root: Path, cfg: IngestConfig, limits: Limits, kept_by_hash: dict[str, str]
) -> tuple[dict[str, Any], Image.Image]:
    """Validate and normalise one entry; raises Reject with the first problem found."""
    if entry.reject is not None:
        raise entry.reject
    data = read_bytes(root, entry.path)
    sha256 = hashlib.sha256(data).hexdigest()
    if sha256 in kept_by_hash:
        first = kept_by_hash[sha256]
        raise Reject("duplicate", f"same bytes as {first}", duplicate_of=first)
    source_image = decode(data, limits)
    caption = read_caption(root, entry)
    image = normalise(source_image, cfg.resolution, cfg.center_crop)
    row = {
        "file_name": output_name(entry.rel, sha256),
        "text": caption if caption is not None else cfg.caption_fallback,
        "caption_source": "file" if caption is not None else "fallback",
        "source": entry.rel,
        "sha256": sha256,
        "width": image.width,
        "height": image.height,
        "source_width": source_image.width,
        "source_height": source_image.height,
    }
    return row, image


def require_kept(summary: Summary, source: Path, rejected_path: Path | None = None) -> None:
    """Zero usable images is an error the user must fix, not an empty dataset to train on."""
    if summary.kept:
        return
    where = f"; reasons per file in {rejected_path}" if rejected_path else ""
    counts = {k: v for k, v in summary.report()["rejected_by_reason"].items() if v}
    raise UserError(
        f"ingest.source: no usable images in {source} "
        f"({summary.total} files, rejected: {counts or 'none'}{where}). "
        "Add PNG/JPEG/WebP images (short side at least ingest.min_side px) or point "
        "ingest.source elsewhere; for the demo run `make data`."
    )
