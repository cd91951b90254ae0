"""Where inputs come from: each source type turns its params into a stream of `Item`s.

An item is one input: a file (or a hub row) plus what is already known about it (caption, tags,
score), or a rejection decided without reading pixels (wrong extension, orphan caption, a
directory link leaving the root, a metadata rule). Every input file of a local source becomes
exactly one item, so downstream every file is accounted for: kept or rejected.

Sources stream: folders are walked one directory at a time in sorted order, so a source of any
size costs memory for one directory listing, not for the whole tree. The imagefolder source
holds its metadata rows (captions) in memory, as the Hugging Face loader does.
"""
from __future__ import annotations

import csv
import io
import json
import logging
import os
import posixpath
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tasks.common.errors import UserError
from tasks.common.outputs import OUTPUT_MARKER
from tasks.ingest import kohya, references
from tasks.ingest.checks import METADATA_MAX_BYTES, Reject, read_bytes
from tasks.ingest.config import FolderSource, ImageFolderSource
from tasks.ingest.masks import MASKLABEL_SUFFIX
from tasks.ingest.work import Task

log = logging.getLogger(__name__)

#: Extensions treated as images (case-insensitive). Anything else is rejected by name.
IMAGE_EXTENSIONS = frozenset({".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff"})
IMAGEFOLDER_METADATA = ("metadata.jsonl", "metadata.csv")


@dataclass
class Item:
    """One input of a source, on its way to being kept or rejected."""

    source: str  # the source's label (its path in params, or the hub dataset name)
    rel: str  # the input's path inside the source (POSIX), what reports name
    task: Task | None = None  # what a worker reads; None when already rejected
    text: str | None = None  # caption known before reading (metadata, instance prompt)
    caption_source: str = "none"  # file | instance_prompt | metadata | tags | hub | none
    tags: list[str] | None = None  # metadata_json: the tags, caption-ready (rules applied)
    tag_separator: str | None = None
    score: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # more columns for the rows
    reject: Reject | None = None
    concept: str | None = None  # the concept its rows name (a kohya folder's, else the source's)
    repeats: int = 1
    concept_caption: str | None = None  # a kohya folder's class tokens: the caption when no sidecar has one

    @classmethod
    def rejected(cls, source: str, rel: str, reject: Reject, **extra: Any) -> Item:
        return cls(source, rel, reject=reject, extra=extra)


def source_root(path: Path, key: str) -> Path:
    """The resolved source folder, or a UserError naming the params key and the fix."""
    if not path.exists():
        hint = (
            "Generate the demo images with `make data` (or `python data/demo/generate.py`), or"
            if path.as_posix().rstrip("/").endswith("data/demo/subject")
            else "Check the path, or"
        )
        raise UserError(
            f"{key}: {path} does not exist. {hint} set {key} in params.yaml to a folder of images."
        )
    if not path.is_dir():
        raise UserError(f"{key}: {path} is not a folder; set {key} to a folder of images.")
    return path.resolve()


def walk(root: Path, label: str, skip: tuple[Path | None, ...] = ()) -> Iterator[tuple[Path, list[str], list[Item]]]:
    """(directory, its file names in order, rejected directory links) for each directory under root.

    Directory symlinks are not followed: one leading outside the root is rejected, one inside is
    skipped (its files are listed at their real location). `skip`: folders not walked (masks, references).
    """
    skipped = {p for p in skip if p is not None}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        here = Path(dirpath)
        dirnames[:] = sorted(d for d in dirnames if here / d not in skipped)
        rejected = []
        for d in dirnames:
            link = here / d
            if link.is_symlink():
                try:
                    target = link.resolve()
                except (OSError, RuntimeError) as err:  # a symlink loop
                    reject = Reject("unreadable", f"cannot resolve: {err}")
                    rejected.append(Item.rejected(label, _rel(root, link), reject))
                    continue
                if target != root and root not in target.parents:
                    reject = Reject("outside_root", f"directory link to {target}")
                    rejected.append(Item.rejected(label, _rel(root, link), reject))
                else:
                    log.debug("not following directory link %s (inside the root)", link)
        names = [n for n in filenames if n != OUTPUT_MARKER]  # the demo generator's output marker: not data
        # Real files before links, so that of two identical files the link is the duplicate.
        yield here, sorted(names, key=lambda n: ((here / n).is_symlink(), n)), rejected


def _rel(root: Path, path: Path) -> str:
    return path.relative_to(root).as_posix()


def _is_image(name: str) -> bool:
    return Path(name).suffix.lower() in IMAGE_EXTENSIONS


def iter_folder(src: FolderSource, label: str, key: str) -> Iterator[Item]:
    """Images at any depth; caption from a sidecar (first of caption_extensions) or the prompt;
    mask from `mask_dir` or a `<stem>-masklabel.png` beside the image (tasks/ingest/masks.py).

    With `kohya_folders`, each sub-folder `<repeats>_<name>` is a concept (tasks/ingest/kohya.py).
    """
    root = source_root(src.path, f"{key}.path")
    if src.kohya_folders:
        yield from kohya.tagged(_folder_items(src, root, label, key), kohya.concept_folders(root, key))
    else:
        kohya.hint_if_kohya_like(root, key)
        yield from _folder_items(src, root, label, key)


def _folder_items(src: FolderSource, root: Path, label: str, key: str) -> Iterator[Item]:
    masks = _mask_root(root, src.mask_dir, f"{key}.mask_dir")
    controls = _control_root(root, src.control_dir, f"{key}.control_dir")
    for here, names, rejected in walk(root, label, skip=(masks, controls)):
        yield from rejected
        label_of = {n[: -len(MASKLABEL_SUFFIX)]: n for n in names if n.lower().endswith(MASKLABEL_SUFFIX)}
        labels = set(label_of.values())
        image_stems = {Path(n).stem for n in names if _is_image(n) and n not in labels}
        caption_of = _caption_files(names, labels, src.caption_extensions)
        consumed = set(caption_of.values())
        in_mask_dir = _listing(masks / here.relative_to(root)) if masks is not None else {}
        refs_here = references.listing(controls / here.relative_to(root), image_stems) if controls else {}
        for name in names:
            path = here / name
            rel = _rel(root, path)
            if name in labels:
                if name[: -len(MASKLABEL_SUFFIX)] not in image_stems:
                    yield Item.rejected(label, rel, Reject("orphan_mask", "no image with this stem beside it"))
            elif _is_image(name):
                mask, mask_source = _mask_of(name, here, label_of, in_mask_dir)
                sidecar = caption_of.get(name)
                item = _image_item(src, root, path, label, rel, here / sidecar if sidecar else None, mask, mask_source)
                yield _with_references(item, refs_here.get(Path(name).stem, []), controls is not None)
            elif name in consumed:
                continue  # a caption, consumed by its image
            elif Path(name).suffix.lower() in src.caption_extensions:
                yield Item.rejected(label, rel, Reject("orphan_caption", "no image with this stem"))
            else:
                what = Path(name).suffix.lower() or "no extension"
                reason = Reject("unsupported_extension", f"{what} is not an image type")
                yield Item.rejected(label, rel, reason)


def _caption_files(names: list[str], labels: set[str], extensions: Iterable[str]) -> dict[str, str]:
    """{image: its caption file} in one folder's listing: the first of `extensions` (either case) with
    the image's stem that no earlier image took (masklabels are not images)."""
    present = set(names)
    by_sidecar: dict[str, str] = {}  # sidecar name -> the image name that consumes it
    for name in names:
        if _is_image(name) and name not in labels:
            stem = Path(name).stem
            for ext in extensions:
                candidates = [n for n in (stem + ext, stem + ext.upper()) if n in present]
                if candidates and candidates[0] not in by_sidecar:
                    by_sidecar[candidates[0]] = name
                    break
    return {image: sidecar for sidecar, image in by_sidecar.items()}


def _image_item(src: FolderSource, root: Path, path: Path, label: str, rel: str, caption: Path | None,
                mask: str | None, mask_source: str | None) -> Item:
    """An image of a folder source: its caption file (or the source's instance prompt) and its mask."""
    if src.instance_prompt is not None:
        task = Task(root=str(root), path=str(path), mask_path=mask, mask_source=mask_source)
        return Item(label, rel, task, src.instance_prompt, "instance_prompt")
    cap = str(caption) if caption else None
    task = Task(root=str(root), path=str(path), caption_path=cap, mask_path=mask, mask_source=mask_source)
    return Item(label, rel, task, caption_source="file" if cap else "none")


def _with_references(item: Item, refs: list[str], wanted: bool) -> Item:
    """An image item with its reference files; without any where the source expects them: rejected."""
    if wanted and not refs:
        return Item.rejected(item.source, item.rel, Reject(
            "missing_reference", "no reference image with this stem (or stem_0, stem_1, ...) in control_dir"))
    if refs:
        item.task = replace(item.task, references=tuple(refs))
    return item


def _control_root(root: Path, control_dir: str | None, key: str) -> Path | None:
    """The source's folder of reference images (it must exist inside the root), or None."""
    if control_dir is None:
        return None
    folder = root / control_dir
    if not folder.is_dir() or folder.is_symlink():
        raise UserError(f"{key}: {folder} is not a folder; create it with the reference images (same relative "
                        "path and stem as their targets, or stem_0, stem_1, ... for several) or remove control_dir.")
    return folder


def _mask_root(root: Path, mask_dir: str | None, key: str) -> Path | None:
    """The source's mask folder (it must exist inside the root), or None."""
    if mask_dir is None:
        return None
    folder = root / mask_dir
    if not folder.is_dir() or folder.is_symlink():
        raise UserError(f"{key}: {folder} is not a folder; create it with the masks (same relative path "
                        "and stem as their images) or remove mask_dir.")
    return folder


def _listing(folder: Path) -> dict[str, str]:
    """{stem: path} of the images in one folder of the mask tree (empty when it is absent)."""
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return {}
    found: dict[str, str] = {}
    for name in names:
        if _is_image(name):
            found.setdefault(Path(name).stem, str(folder / name))
    return found


def _mask_of(name: str, here: Path, label_of: dict[str, str], in_mask_dir: dict[str, str],
             ) -> tuple[str | None, str | None]:
    """(mask file path, mask_source) of an image: the mask folder's file first, then its masklabel."""
    stem = Path(name).stem
    if stem in in_mask_dir:
        return in_mask_dir[stem], "file"
    if stem in label_of:
        return str(here / label_of[stem]), "masklabel"
    return None, None


def iter_imagefolder(src: ImageFolderSource, label: str, key: str) -> Iterator[Item]:
    """A Hugging Face imagefolder: `file_name` in metadata.jsonl/.csv (any depth) gives captions.

    `file_name` is relative to the metadata file's folder, as in `datasets`. Images without a
    row get no caption (the caption policy decides); rows naming no existing file are rejected.
    """
    root = source_root(src.path, f"{key}.path")
    refs: dict[str, list[str] | Reject] = {}
    captions, problems = _read_imagefolder_metadata(root, src.caption_column, label, key,
                                                    (src.cond_image_column, refs))
    referenced = {r for paths in refs.values() if isinstance(paths, list) for r in paths}
    yield from problems
    for here, names, rejected in walk(root, label):
        yield from rejected
        label_of = {n[: -len(MASKLABEL_SUFFIX)]: n for n in names if n.lower().endswith(MASKLABEL_SUFFIX)}
        for name in names:
            path = here / name
            rel = _rel(root, path)
            if name in IMAGEFOLDER_METADATA or (rel in referenced and rel not in captions):
                continue  # the metadata, or a reference image (not a target of its own)
            if name in label_of.values() and rel not in captions:  # a mask (unless the metadata lists it)
                if not any(Path(n).stem == name[: -len(MASKLABEL_SUFFIX)] for n in names if _is_image(n)
                           and n not in label_of.values()):
                    yield Item.rejected(label, rel, Reject("orphan_mask", "no image with this stem beside it"))
                continue
            text = captions.pop(rel, None)
            if not _is_image(name):
                what = Path(name).suffix.lower() or "no extension"
                reason = Reject("unsupported_extension", f"{what} is not an image type")
                yield Item.rejected(label, rel, reason)
                continue
            how = "metadata" if text is not None else "none"
            mask, mask_source = _mask_of(name, here, label_of, {})
            item = Item(label, rel, Task(root=str(root), path=str(path), mask_path=mask, mask_source=mask_source),
                        text, how)
            yield _column_references(item, root, refs.get(rel, []), src.cond_image_column is not None)
    for rel in sorted(captions):  # rows whose file was not found on disk
        target = root / rel
        reject = (
            Reject("broken_symlink", f"points to missing {os.readlink(target)}")
            if target.is_symlink()
            else Reject("missing_image", "listed in the metadata, not found")
        )
        yield Item.rejected(label, rel, reject)


def _column_references(item: Item, root: Path, refs: list[str] | Reject, wanted: bool) -> Item:
    """An imagefolder item with the references its row names (cond_image_column)."""
    if isinstance(refs, Reject):
        return Item.rejected(item.source, item.rel, refs)
    return _with_references(item, [str(root / r) for r in refs], wanted)


def _row_references(row: dict, column: str, base: str) -> list[str] | Reject:
    """The reference paths (relative to the root) a metadata row names in `column`: a path or a list."""
    value = row.get(column)
    values = value if isinstance(value, list) else [] if value in (None, "") else [value]
    paths = []
    for ref in values:
        if not isinstance(ref, str) or not ref or "://" in ref or ref.startswith("/"):
            return Reject("bad_metadata", f"{column}: {ref!r} is not a relative path (or list of them)")
        paths.append(posixpath.normpath(posixpath.join(base, ref)))
    return paths


def read_metadata_captions(root: Path, column: str, label: str, key: str) -> tuple[dict[str, str | None], list[Item]]:
    """{path relative to root: caption} from the metadata.jsonl/.csv files under root (none: {}), and rejected
    rows; for sources whose captions may also come from elsewhere (clips: sidecars)."""
    return _read_imagefolder_metadata(root, column, label, key, warn_if_none=False)


def _read_imagefolder_metadata(
    root: Path, column: str, label: str, key: str,
    references: tuple[str | None, dict[str, list[str] | Reject]] = (None, {}), warn_if_none: bool = True,
) -> tuple[dict[str, str | None], list[Item]]:
    """{image path relative to root: caption} from every metadata file, and rejected rows.

    `references`: (cond_image_column, a dict filled with {image path: its reference paths or a Reject})."""
    cond_column, refs = references
    captions: dict[str, str | None] = {}
    problems: list[Item] = []
    seen_column = False
    files = 0
    for here, names, _ in walk(root, label):
        for meta in (n for n in names if n in IMAGEFOLDER_METADATA):
            files += 1
            meta_rel = _rel(root, here / meta)
            base = posixpath.dirname(meta_rel)
            try:
                rows, has_column = _rows(read_bytes(root, here / meta, METADATA_MAX_BYTES), meta, column)
            except Reject as err:
                raise UserError(f"{key}: metadata file {meta_rel}: {err}") from None
            seen_column |= has_column
            for line, row in rows:
                where = f"{meta_rel}:{line}"
                name = row.get("file_name") if isinstance(row, dict) else None
                if not isinstance(name, str) or not name or "://" in name or name.startswith("/"):
                    detail = "no relative `file_name`" if isinstance(row, dict) else "not an object"
                    problems.append(Item.rejected(label, where, Reject("bad_metadata", detail)))
                    continue
                rel = posixpath.normpath(posixpath.join(base, name))
                if rel.startswith("../") or rel == "..":
                    reason = Reject("outside_root", f"file_name {name!r} leaves the dataset root")
                    problems.append(Item.rejected(label, where, reason))
                elif rel in captions:
                    reason = Reject("bad_metadata", f"{rel} is listed again")
                    problems.append(Item.rejected(label, where, reason))
                else:
                    value = row.get(column)
                    captions[rel] = None if value is None else " ".join(str(value).split())
                    if cond_column is not None:
                        refs[rel] = _row_references(row, cond_column, base)
    if files and not seen_column:
        raise UserError(
            f"{key}.caption_column: no metadata file under {root} has a column {column!r}; set "
            "caption_column to the column holding the captions."
        )
    if not files and warn_if_none:
        log.warning("%s: no metadata.jsonl or metadata.csv under %s: no captions", key, root)
    return captions, problems


def _rows(data: bytes, name: str, column: str) -> tuple[list[tuple[int, Any]], bool]:
    """(line number, row) pairs of a metadata file, and whether `column` appears in it."""
    text = data.decode("utf-8-sig", errors="replace")
    if name.endswith(".csv"):
        reader = csv.DictReader(io.StringIO(text))
        rows = [(i + 2, dict(r)) for i, r in enumerate(reader)]
        return rows, column in (reader.fieldnames or [])
    rows = []
    for i, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append((i, json.loads(line)))
            except ValueError:
                rows.append((i, None))
    return rows, any(isinstance(r, dict) and column in r for _, r in rows)
