"""Helpers for the ingest tests: distinct test pictures, a config builder, a run that reads back."""
from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from tasks.ingest.config import IngestConfig
from tasks.ingest.core import METADATA, Summary, ingest


def picture(seed: int, size: tuple[int, int] = (96, 96), mode: str = "RGB") -> Image.Image:
    """A blocky random picture: distinct seeds give far-apart perceptual hashes.

    (Solid colours all share one perceptual hash, so they would all be near-duplicates.)
    """
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
    image = Image.fromarray(blocks, "RGB").resize(size, Image.Resampling.NEAREST)
    return image.convert(mode) if mode != "RGB" else image


def save(path: Path, image: Image.Image, caption: str | None = None, **kw: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, **kw)
    if caption is not None:
        path.with_suffix(".txt").write_text(caption, encoding="utf-8")
    return path


def bomb_png(width: int, height: int) -> bytes:
    """A 1-bit all-black PNG of `width` x `height`, written row by row: a few KiB on disk however many
    pixels it claims (PIL would need width x height bytes of memory to make it, or to decode it)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    pack, row = zlib.compressobj(9), b"\0" * (1 + (width + 7) // 8)
    pixels = b"".join(pack.compress(row) for _ in range(height)) + pack.flush()
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)  # 1 bit, greyscale
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b"")


def config(sources: list[dict] | Path, **overrides: Any) -> IngestConfig:
    """An IngestConfig for tests: one process and no cache unless a test asks for them.

    No data_dir unless a test asks: the sources name their own folders (anywhere under tmp).
    """
    if isinstance(sources, Path):
        sources = [{"type": "folder", "path": str(sources)}]
    data = {"data_dir": None, "sources": sources, "workers": 1, "cache_dir": None, **overrides}
    return IngestConfig.model_validate(data)


@dataclass
class Run:
    summary: Summary
    out: Path
    kept: list[dict]
    rejected: list[dict]

    def reasons(self) -> dict[str, str]:
        return {r["path"]: r["reason"] for r in self.rejected}

    def by_path(self) -> dict[str, dict]:
        return {r["path"]: r for r in self.kept}

    def image(self, row: dict) -> Image.Image:
        return Image.open(self.out / row["file_name"])


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def run(cfg: IngestConfig, out: Path) -> Run:
    out.mkdir(parents=True, exist_ok=True)
    rejected = out.parent / f"{out.name}.rejected.jsonl"
    summary = ingest(cfg, out, rejected)
    return Run(summary, out, read_jsonl(out / METADATA), read_jsonl(rejected))


def run_folder(src: Path, out: Path, **overrides: Any) -> Run:
    return run(config(src, **overrides), out)
