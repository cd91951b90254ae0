"""The per-image JSON metadata source and its filter rules (the training notes, seed 003).

Layout: `<root>/<metadata_dir>/<any depth>/<name>.json`, each file an object
`{"tags": [...], "score": 55, "path": "images/287/2877648.png"}` with `path` relative to the
dataset root; extra keys are ignored. Each JSON file is one input: kept (its image) or rejected.

The rules keep the notes' names and order. Tag shuffling, keeping the first N tags and caption
dropout are per-batch random choices made at training time: the kept tags are stored as a list
(`tags` in metadata.jsonl) with the separator, so the train stage can apply them.
"""
from __future__ import annotations

import json
import numbers
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tasks.common.errors import UserError
from tasks.ingest.checks import METADATA_JSON_MAX_BYTES, Reject, read_bytes
from tasks.ingest.config import MetadataJsonSource
from tasks.ingest.sources import Item, source_root, walk
from tasks.ingest.work import Task

SCORE_TAG = "scr{}"  # score_tags: ">3200 = scr3200, >1600 = scr1600, and so on"


def apply_rules(tags: list[str], score: float | None, rules: MetadataJsonSource) -> list[str]:
    """The caption-ready tags of one image, or Reject naming the rule that dropped it.

    Order (the notes'): abs_min_score on the raw score; score_tags adds `scr<t>` for the highest
    threshold the raw score reaches; tag_bonus_scores adjusts the score (each listed tag present
    counts once) and min_score applies to the result; blacklist_tags drops the image;
    non_caption_tags drops tags; replacements rewrite substrings of each tag, in order.
    """
    needs_score = rules.abs_min_score is not None or rules.min_score is not None or rules.score_tags
    if score is None and needs_score:
        raise Reject("bad_metadata", "no numeric `score`, but score rules are set")
    if rules.abs_min_score is not None and score < rules.abs_min_score:
        raise Reject("abs_min_score", f"score {score:g} < abs_min_score {rules.abs_min_score:g}")
    tags = list(tags)
    for threshold in sorted(rules.score_tags, reverse=True):
        if score >= threshold:
            tags.append(SCORE_TAG.format(threshold))
            break
    if rules.min_score is not None:
        present = set(tags)
        bonus = sum(v for tag, v in rules.tag_bonus_scores.items() if tag in present)
        if score + bonus < rules.min_score:
            raise Reject(
                "min_score",
                f"score {score:g} + tag bonus {bonus:g} = {score + bonus:g} "
                f"< min_score {rules.min_score:g}",
            )
    blacklisted = [t for t in tags if t in set(rules.blacklist_tags)]
    if blacklisted:
        raise Reject("blacklist_tags", f"tagged {blacklisted[0]!r}")
    dropped = set(rules.non_caption_tags)
    kept = []
    for tag in tags:
        if tag in dropped:
            continue
        for old, new in rules.replacements.items():
            tag = tag.replace(old, new)
        if tag.strip():
            kept.append(tag)
    return kept


def parse(data: bytes) -> tuple[list[str], float | None, str]:
    """(tags, score, image path) of one metadata file, or Reject("bad_metadata")."""
    try:
        meta = json.loads(data.decode("utf-8-sig"))
    except (UnicodeDecodeError, ValueError) as err:
        raise Reject("bad_metadata", f"not JSON: {err}") from None
    if not isinstance(meta, dict):
        raise Reject("bad_metadata", "not a JSON object")
    tags, score, path = meta.get("tags"), meta.get("score"), meta.get("path")
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise Reject("bad_metadata", "`tags` is not a list of strings")
    if not isinstance(path, str) or not path:
        raise Reject("bad_metadata", "`path` (image path relative to the dataset root) is missing")
    if score is not None and (isinstance(score, bool) or not isinstance(score, numbers.Real)):
        raise Reject("bad_metadata", f"`score` is not a number: {score!r}")
    return tags, score, path


def iter_metadata_json(src: MetadataJsonSource, label: str, key: str) -> Iterator[Item]:
    """One item per file under the metadata folder, in sorted order; rules applied here."""
    root = source_root(src.path, f"{key}.path")
    meta_root = root / src.metadata_dir
    if not meta_root.is_dir():
        raise UserError(
            f"{key}.metadata_dir: {meta_root} is not a folder. The metadata layout is "
            "<root>/<metadata_dir>/**/*.json with `path` relative to <root>; set "
            "metadata_dir to the folder holding the JSON files."
        )
    if meta_root.resolve() != root and root not in meta_root.resolve().parents:
        raise UserError(f"{key}.metadata_dir: {src.metadata_dir} leads outside {root}")
    n_json = 0
    for here, names, rejected in walk(meta_root.resolve(), label):
        yield from rejected
        for name in names:
            rel = Path(here / name).relative_to(root).as_posix()
            if not name.lower().endswith(".json"):
                reason = Reject("unsupported_extension", "not a .json metadata file")
                yield Item.rejected(label, rel, reason)
                continue
            n_json += 1
            nth = src.consider_every_nth
            if nth and (n_json - 1) % nth:
                reason = Reject("consider_every_nth", f"only every {nth}th metadata file is used")
                yield Item.rejected(label, rel, reason)
                continue
            yield _item(src, label, root, here / name, rel)


def _item(src: MetadataJsonSource, label: str, root: Path, path: Path, rel: str) -> Item:
    extra: dict[str, Any] = {}
    try:
        tags, score, image = parse(read_bytes(root, path, METADATA_JSON_MAX_BYTES))
        extra["image"] = image
        tags = apply_rules(tags, score, src)
    except Reject as err:
        return Item.rejected(label, rel, err, **extra)
    text = src.tag_separator.join(tags)
    task = Task(root=str(root), path=str(root / image))
    return Item(
        label, rel, task, text, "tags", tags=tags, tag_separator=src.tag_separator,
        score=score, extra=extra,
    )
