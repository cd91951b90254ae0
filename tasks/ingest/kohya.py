"""kohya's dataset folders: `<train_data_dir>/<repeats>_<name>/` holds one concept's images.

`10_sks dog` means: its images are shown 10 times per epoch, and "sks dog" (kohya's class tokens)
is the caption of an image without a caption file. Here `name` also becomes the rows' `concept`,
which train.concepts and class_images.concepts refer to. Read only when a folder source says
`kohya_folders: true`: a folder named `2_cats` in an ordinary dataset stays an ordinary folder.
"""
from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.common.concepts import concept_name_problem
from tasks.common.errors import UserError
from tasks.ingest.config import MAX_REPEATS

log = logging.getLogger(__name__)

FOLDER = re.compile(r"^(\d+)_(.+)$")


@dataclass(frozen=True)
class ConceptFolder:
    name: str  # the concept, and the caption of its images without a caption file
    repeats: int


def parse(folder_name: str) -> ConceptFolder | None:
    """`10_sks dog` -> ConceptFolder("sks dog", 10); None when the name is not `<int>_<name>`."""
    match = FOLDER.match(folder_name)
    if not match or not match.group(2).strip():
        return None
    return ConceptFolder(match.group(2).strip(), int(match.group(1)))


def concept_folders(root: Path, key: str) -> dict[str, ConceptFolder]:
    """{sub-folder name: its concept} of a kohya train_data_dir; a UserError for anything else there."""
    subdirs = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    files = sorted(p.name for p in root.iterdir() if p.is_file() and not p.name.startswith("."))
    fix = f"set {key}.kohya_folders: false to read {root} as an ordinary folder"
    if files:
        raise UserError(f"{key}: with kohya_folders, images lie in sub-folders named `<repeats>_<name>` "
                        f"(e.g. `10_sks dog`), but {root} holds files itself ({', '.join(files[:3])}); "
                        f"move them into such a sub-folder, or {fix}")
    folders: dict[str, ConceptFolder] = {}
    for sub in subdirs:
        concept = parse(sub.name)
        if concept is None:
            raise UserError(f"{key}: sub-folder {sub.name!r} of {root} is not named `<repeats>_<name>` "
                            f"(kohya's, e.g. `10_sks dog`); rename it, or {fix}")
        if concept.repeats < 1:
            raise UserError(f"{key}: sub-folder {sub.name!r}: repeats is at least 1; rename it")
        if concept.repeats > MAX_REPEATS:
            raise UserError(f"{key}: sub-folder {sub.name!r} of {root}: {concept.repeats} repeats is over the cap of "
                            f"{MAX_REPEATS} (train.concepts' too); rename it with fewer, e.g. "
                            f"`{MAX_REPEATS}_{concept.name}`")
        if problem := concept_name_problem(concept.name):
            raise UserError(f"{key}: sub-folder {sub.name!r}: {problem}; rename it")
        clash = [f for f, c in folders.items() if c.name == concept.name]
        if clash:
            raise UserError(f"{key}: sub-folders {clash[0]!r} and {sub.name!r} are both concept {concept.name!r}; "
                            "give each concept one folder (or two names)")
        folders[sub.name] = concept
    if not folders:
        raise UserError(f"{key}: kohya_folders is on but {root} has no sub-folder `<repeats>_<name>`; add one, "
                        f"or {fix}")
    log.info("%s: kohya folders: %s", key, ", ".join(f"{c.name!r} x{c.repeats}" for c in folders.values()))
    return folders


def tagged(items: Iterable[Any], folders: dict[str, ConceptFolder]) -> Iterator[Any]:
    """The items (sources.Item) with the concept, repeats and fallback caption of the sub-folder they lie in."""
    for item in items:
        concept = folders.get(item.rel.split("/", 1)[0]) if "/" in item.rel else None
        if concept is not None:
            item.concept, item.repeats, item.concept_caption = concept.name, concept.repeats, concept.name
        yield item


def hint_if_kohya_like(root: Path, key: str) -> None:
    """A folder laid out as kohya's, read as an ordinary one: say how to read it as concepts."""
    subdirs = [p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")]
    if subdirs and all(parse(name) for name in subdirs):
        log.warning("%s: every sub-folder of %s is named like kohya's `<repeats>_<name>` (%s); they are read as "
                    "ordinary folders. Set %s.kohya_folders: true to read each as a concept with its repeats",
                    key, root, ", ".join(sorted(subdirs)[:3]), key)
