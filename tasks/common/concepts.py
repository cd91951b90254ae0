"""Concepts: several datasets trained in one run (kohya's subsets, OneTrainer's concepts).

A concept's name travels through the stages: ingest writes it in each row (`concept`), class_images
makes `data/class_images/<name>/`, train pairs each image with its own concept's class images and
reports per concept. So a name must be usable as a folder name; this rule is shared by the stages.
"""
from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, Field


def concept_name_problem(name: str) -> str | None:
    """Why `name` cannot name a concept (it becomes a folder, data/class_images/<name>/), or None."""
    if not name.strip() or name != name.strip():
        return f"a concept name has no leading or trailing spaces (got {name!r})"
    if any(c in name for c in "/\\\0") or name.startswith("."):
        return f"a concept name is a folder name: no '/', '\\' or leading '.' (got {name!r})"
    return None


def _valid_name(name: str) -> str:
    if problem := concept_name_problem(name):
        raise ValueError(problem)
    return name


#: A concept's name in a stage config (class_images.concepts, train.concepts), checked as above.
ConceptName = Annotated[str, Field(min_length=1, max_length=128), AfterValidator(_valid_name)]


def metric_key(name: str) -> str:
    """The name as MLflow takes it in a metric or param key (letters, digits, _ - . space /)."""
    return re.sub(r"[^\w\-. ]", "_", name)
