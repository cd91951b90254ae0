"""A dataset from the Hugging Face Hub (or anything `datasets.load_dataset` takes by name).

Rows are streamed (`streaming=True`): nothing is downloaded up front and memory stays flat. The
image column is read undecoded (`datasets.Image(decode=False)`), so each row's original bytes go
through the same checks, hashing and cache as files on disk.

Reproducibility: DVC cannot hash a hub dataset, so the stage cannot depend on it the way it
depends on a folder. The source's `revision` (required) is in params.yaml, so pinning a commit
hash makes the params change whenever the data may have; a branch name like "main" does not.
"""
from __future__ import annotations

import io
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tasks.common.errors import UserError
from tasks.ingest.checks import Reject, read_regular
from tasks.ingest.config import HubSource
from tasks.ingest.sources import Item
from tasks.ingest.work import Task

log = logging.getLogger(__name__)


def _offline_help(src: HubSource, key: str, err: BaseException) -> UserError:
    return UserError(
        f"{key}: could not load dataset {src.name!r} (revision {src.revision}, split "
        f"{src.split}) with datasets.load_dataset: {type(err).__name__}: {err}. Hub datasets "
        "need network access to huggingface.co (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE must be "
        "unset). Offline, download it elsewhere, save its images with a metadata.jsonl, and use "
        "an `imagefolder` source instead."
    )


def open_dataset(src: HubSource, key: str) -> Any:
    """The streaming dataset with its image column undecoded; UserError when it cannot load."""
    try:
        import datasets

        ds = datasets.load_dataset(
            src.name, src.subset, split=src.split, revision=src.revision, streaming=True
        )
    except Exception as err:  # network, auth, missing repo or split: all "cannot load"
        raise _offline_help(src, key, err) from None
    columns = list(ds.features or {}) if getattr(ds, "features", None) else []
    wanted = [("image_column", src.image_column), ("caption_column", src.caption_column)]
    wanted += [("cond_image_column", src.cond_image_column)] if src.cond_image_column else []
    for col_key, column in wanted:
        if columns and column not in columns:
            raise UserError(
                f"{key}.{col_key}: {src.name} has no column {column!r}; its columns: "
                f"{', '.join(columns)}"
            )
    ds = ds.cast_column(src.image_column, datasets.Image(decode=False))
    feature = (getattr(ds, "features", None) or {}).get(src.cond_image_column) if src.cond_image_column else None
    if isinstance(feature, datasets.Image):  # one image per row; a list of images stays as it is
        ds = ds.cast_column(src.cond_image_column, datasets.Image(decode=False))
    return ds


def _read_local(src: HubSource, path: str) -> bytes:
    """The bytes of a row's local image `path`, which must lie inside the dataset's own folder (as a
    local source's files must lie inside its root): a row cannot make the stage read any file."""
    root = Path(src.name).expanduser()
    if not root.is_dir():
        raise Reject("outside_root", f"{path}: a local file, but {src.name} is not a local dataset folder")
    root = root.resolve()
    try:
        target = (root / Path(path).expanduser()).resolve()  # an absolute path stays itself
    except (OSError, RuntimeError) as err:  # a symlink loop
        raise Reject("unreadable", f"{path}: cannot resolve: {err}") from None
    if root not in target.parents:
        raise Reject("outside_root", f"{path} lies outside the dataset folder {root}")
    try:
        return read_regular(target)  # a FIFO or device is rejected unopened
    except Reject as err:
        raise Reject(err.reason, f"{path}: {err.detail}") from None


def iter_hub(src: HubSource, label: str, key: str) -> Iterator[Item]:
    """One item per row (up to `limit`), named `<split>/<row index>`."""
    ds = open_dataset(src, key)
    rows = iter(ds)
    index = 0
    while src.limit is None or index < src.limit:
        try:
            row = next(rows)
        except StopIteration:
            return
        except Exception as err:  # the stream can fail midway (network)
            raise _offline_help(src, key, err) from None
        rel = f"{src.split}/{index}"
        index += 1
        image = row.get(src.image_column) or {}
        data = image.get("bytes")
        if data is None and image.get("path"):
            try:  # local datasets give a path, not bytes
                data = _read_local(src, str(image["path"]))
            except Reject as reject:
                yield Item.rejected(label, rel, reject)
                continue
        caption = row.get(src.caption_column)
        text = None if caption is None else " ".join(str(caption).split())
        try:
            refs = _references(src, row)
        except Reject as reject:
            yield Item.rejected(label, rel, reject)
            continue
        yield Item(label, rel, Task(data=data or b"", reference_data=refs), text, "hub")


def _references(src: HubSource, row: dict[str, Any]) -> tuple[bytes, ...]:
    """A row's reference images' bytes (cond_image_column: an image or a list of them)."""
    if src.cond_image_column is None:
        return ()
    value = row.get(src.cond_image_column)
    images = value if isinstance(value, list) else [] if value is None else [value]
    refs = []
    for image in images:
        if hasattr(image, "save"):  # a decoded PIL image (a list-of-images column): lossless bytes again
            buf = io.BytesIO()
            image.save(buf, format="PNG")
            image = buf.getvalue()
        image = image if isinstance(image, dict) else {"bytes": image} if isinstance(image, bytes) else {}
        data = image.get("bytes")
        if data is None and image.get("path"):
            try:
                data = _read_local(src, str(image["path"]))
            except Reject as err:
                raise Reject("outside_root" if err.reason == "outside_root" else "bad_reference",
                             f"reference {err.detail}") from None
        if not data:
            raise Reject("bad_reference", f"reference #{len(refs)} in {src.cond_image_column!r} has no image data")
        refs.append(data)
    if not refs:
        raise Reject("missing_reference", f"no reference image in column {src.cond_image_column!r}")
    return tuple(refs)
