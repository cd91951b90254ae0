"""SHA-256 of files and of model folders: what the outputs' reports and staleness checks compare.

Used by `class_images` (are the images on disk from this base model?) and `train` (hashes of the
weights it wrote). Streaming, so multi-GB weights are never held in memory.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

WEIGHT_SUFFIXES = (".safetensors", ".bin")
_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def weight_hashes(folder: Path) -> dict[str, str]:
    """{relative posix path: sha256} of every weight file under `folder`, sorted by path."""
    folder = Path(folder)
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix in WEIGHT_SUFFIXES)
    return {p.relative_to(folder).as_posix(): sha256_file(p) for p in files}


def folder_fingerprint(folder: Path) -> str:
    """One SHA-256 over every file of a model folder (paths and contents), hidden files excluded.

    Two folders with the same fingerprint hold the same model, whatever their location or mtimes.
    """
    folder = Path(folder)
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        if any(part.startswith(".") for part in rel.split("/")):
            continue
        digest.update(rel.encode() + b"\0" + sha256_file(path).encode() + b"\n")
    return digest.hexdigest()
