"""Finish a registration that was cut off, instead of registering the same model twice.

A registration has one commit point, `create_model_version` (tasks/register/core.py), and then
three more writes: lineage.json naming the version, the aliases, the lineage digest param
(tasks/register/manifest.py). A worker killed between them leaves a complete version that no
alias reaches, or whose lineage document does not name it yet. Every version is created with the
tag `registration=incomplete`, set to `complete` after the last write, so such a version is
visible; the next registration of the same inputs (lineage fingerprint) finishes it:

- its run's lineage digest is already recorded: every write was done but the tag; the tag is set;
- otherwise the champion decision is taken again (the champion may have moved meanwhile), the
  lineage document rewritten with it and the version's number, the aliases moved, the digest
  recorded and the tag set, in the version's own run.

A version whose run is still RUNNING (another registration under way) is left to it. Versions
registered before the tag existed carry none and count as complete.
"""
from __future__ import annotations

import json
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.register.manifest import LINEAGE_PARAM, model_key
from tasks.register.promotion import Champion
from tasks.register.registry import LINEAGE_ARTIFACT, champion_of

log = logging.getLogger(__name__)

REGISTRATION_TAG = "registration"
INCOMPLETE, COMPLETE = "incomplete", "complete"


@dataclass(frozen=True)
class Unfinished:
    """A version whose registration stopped after its creation."""
    version: str
    run_id: str
    source: str
    record: dict[str, Any]  # its lineage document as stored
    lineage_final: bool  # the digest is recorded: only the tag was left


def is_incomplete(version: Any) -> bool:
    return (getattr(version, "tags", None) or {}).get(REGISTRATION_TAG) == INCOMPLETE


def _stored_record(client: Any, run_id: str) -> dict[str, Any] | None:
    """The run's lineage document, whatever version it names (None: none readable)."""
    if LINEAGE_ARTIFACT not in {Path(f.path).name for f in client.list_artifacts(run_id)}:
        return None
    with tempfile.TemporaryDirectory(prefix="lineage-") as tmp:
        try:
            doc = json.loads(Path(client.download_artifacts(run_id, LINEAGE_ARTIFACT, tmp)).read_text())
        except (OSError, ValueError):
            return None
    return doc if isinstance(doc, dict) else None


def find_unfinished(client: Any, model_name: str, fingerprint: str, own_run: str) -> Unfinished | None:
    """The newest version of `model_name` built from `fingerprint` whose registration was cut off
    (its run ended, or it is `own_run`: this registration's own earlier attempt)."""
    versions = [v for v in client.search_model_versions(f"name='{model_name}'") if is_incomplete(v)]
    for v in sorted(versions, key=lambda v: -int(v.version)):
        if not v.run_id:
            continue
        run = client.get_run(v.run_id)
        if run.info.status == "RUNNING" and v.run_id != own_run:
            continue
        record = _stored_record(client, v.run_id)
        if record is None or record.get("fingerprint") != fingerprint:
            continue
        final = LINEAGE_PARAM.format(model_key(v.source)) in run.data.params
        return Unfinished(str(v.version), v.run_id, v.source, record, final)
    return None


def mark_complete(client: Any, model_name: str, version: str) -> None:
    client.set_model_version_tag(model_name, version, REGISTRATION_TAG, COMPLETE)


def retag(client: Any, model_name: str, version: str, tags: dict[str, str]) -> None:
    """The decision's tags on a version whose decision was taken again."""
    for key, value in tags.items():
        client.set_model_version_tag(model_name, version, key, value[:5000])


def announce(model_name: str, unfinished: Unfinished) -> None:
    log.warning("%s version %s (run %s) was created but its registration was cut off before %s; "
                "finishing it instead of registering the same inputs again", model_name, unfinished.version,
                unfinished.run_id, "its last tag" if unfinished.lineage_final else "its aliases moved")


def champion_to_beat(client: Any, model_name: str, champion: Champion | None, unfinished: Unfinished | None,
                     metric: str) -> Champion | None:
    """The champion the decision compares with. When the cut-off version itself already holds
    `champion` (its aliases moved before the cut), it is the one it beat, as its lineage says."""
    if unfinished is None or champion is None or champion.version != unfinished.version:
        return champion
    previous = str((unfinished.record.get("champion") or {}).get("champion.previous_version", "none"))
    if previous == "none":
        return None
    return champion_of(client, client.get_model_version(model_name, previous), metric)
