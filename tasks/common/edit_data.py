"""Whether params.yaml asks ingest for an edit dataset: (reference images, target, instruction) triples.

An ingest source names each target's reference images with `control_dir` (a folder source) or
`cond_image_column` (an imagefolder or hub source); ingest then lists them in metadata.jsonl's
`reference_file_names`. Known from params alone, before ingest runs, so the flow's up-front check
(flows/combinations.py) and the class_images stage can refuse what an edit dataset cannot train with
(class images: they have no reference images) before anything is made for it.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: the keys of an ingest source that give its targets reference images
REFERENCE_KEYS = ("control_dir", "cond_image_column")


def reference_sources(ingest: Any) -> list[str]:
    """`ingest.sources[i].<key>` for each source that gives its targets reference images; [] for a
    dataset of plain images. `ingest` is the section as a typed config or as params.yaml's mapping."""
    sources = ingest.get("sources") if isinstance(ingest, Mapping) else getattr(ingest, "sources", None)
    found = []
    for i, source in enumerate(sources or ()):
        for key in REFERENCE_KEYS:
            value = source.get(key) if isinstance(source, Mapping) else getattr(source, key, None)
            if value:
                found.append(f"ingest.sources[{i}].{key}")
    return found


def prior_preservation_problem(ingest: Any, with_prior_preservation: bool) -> str | None:
    """The refusal of prior preservation beside an edit dataset, naming both keys and the fix; None when
    the pair can train."""
    if not with_prior_preservation or not (keys := reference_sources(ingest)):
        return None
    return (f"train.with_prior_preservation: true beside an edit dataset ({keys[0]}: reference images): class "
            "images have no reference images, so prior preservation cannot train beside it; set "
            "train.with_prior_preservation: false (the class_images stage then makes none)")
