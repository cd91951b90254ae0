"""What promotion reads from the MLflow registry, and the `champion` move checked after it is made.

Where a score comes from. A version's tags (`metric.<primary>`, `protocol`, `lineage.fingerprint`,
`lineage`) are for people reading the registry: anyone allowed to tag a version can change them.
What a version was scored at, under which protocol, and what it was built from is read from its
lineage document instead: `lineage.json` in the version's own run (its `run_id`, fixed when the
version is created; never the run the editable `lineage` tag names), and only when the document
names that version: its `model` section's name, version and run id (and source, when recorded)
are the version's. A tag that disagrees with the document is named in the log and in the
decision; the document wins. A version without a readable document (one registered before
lineage.json existed or before it named its version, or whose document was removed, damaged or
replaced) has no score: as champion it holds (promotion fails closed, tasks/register/promotion.py)
until the flow re-scores it or someone moves the alias by hand, and the reason says why. A
re-scored champion's score counts only inside the flow run that computed it (flows/rescore.py
hands the report to tasks/register in-process); the `rescore.<protocol>` tag it leaves on the
champion is display only and is never read back. Changing a document takes write access to the
run's artifacts (MLflow's experiment permission), not to the model's tags.

The race rule. MLflow moves an alias with no compare-and-set, so two registrations deciding
against the same champion at once could each move it. A promoted version therefore reads
`champion` just before moving it and again after, at most `MOVE_TRIES` moves:
1. the holder is this version: done; if it took the alias from a version other than the champion
   it decided against (a concurrent registration), that version gets `champion.displaced`;
2. another version holds it (moved since the decision, or between our move and our read): decide
   again against that holder by the same rule (gate, protocol, strictly better, its score from
   its lineage document). Better: move again and check again. Not better: this version lost;
   it keeps `candidate` only and records it (`champion.lost_race` naming the holder;
   tasks/register/core.py amends `champion.decision` and the champion section of lineage.json).
Two registrations racing end with one champion, the better one whenever their moves overlap,
and a record on the other. What no read-back can see is a whole move-and-check by another
registration between our last read and our move (two consecutive requests): then the later mover
holds the alias, still one champion, but the earlier one's `champion.decision` says promoted; the
alias (listed on every version) is what says who holds it.
"""
from __future__ import annotations

import json
import logging
import math
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune_runtime.registered import LINEAGE_MAX_BYTES, TooLarge, fetch_capped
from tasks.common.errors import UserError
from tasks.register.manifest import check_lineage
from tasks.register.naming import Lineage, of_record
from tasks.register.oneline import REASON_CHARS, one_line, reason
from tasks.register.promotion import (
    METRIC_TAG,
    Champion,
    Decision,
    protocol_from_tags,
    score_from_tags,
)

log = logging.getLogger(__name__)

#: The version's full lineage, one JSON document in its run (tasks/register/lineage.py).
LINEAGE_ARTIFACT = "lineage.json"
CHAMPION = "champion"
#: How many times a promoted version moves `champion` and reads it back before it gives up.
MOVE_TRIES = 3


def ensure_registered_model(client: Any, name: str) -> None:
    """Registered model `name` exists, or is created here where the store has no users (a local
    store, a server without the basic-auth app). On a server with users (an http(s) URI, the
    client has MLFLOW_TRACKING_USERNAME) the admin's bootstrap creates it (infra/mlflow_access.py): MLflow
    gives whoever creates a registered model MANAGE on it, deletion included."""
    from mlflow.exceptions import MlflowException

    try:
        client.get_registered_model(name)
        return
    except MlflowException as err:
        if err.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
    server = str(getattr(client, "tracking_uri", "")).startswith(("http://", "https://"))
    if server and os.environ.get("MLFLOW_TRACKING_USERNAME"):
        raise UserError(
            f"registered model '{name}' does not exist on the tracking server, and the pipeline's "
            "user does not create it (it would own it, deletion included): the server's admin "
            "creates it with the pipeline's grants, `python infra/mlflow_access.py add-user "
            f"<user> --role pipeline --model {name.removesuffix('-base')}` or `bootstrap` with "
            "REGISTERED_MODEL set (infra/README.md, \"Users and permissions\")")
    try:
        client.create_registered_model(name)
    except MlflowException as err:
        if err.error_code not in ("RESOURCE_ALREADY_EXISTS", "ALREADY_EXISTS"):
            raise


def read_lineage(client: Any, version: Any) -> tuple[dict[str, Any] | None, str]:
    """The lineage document of `version` (a ModelVersion) from its own run, or None and why not."""
    run_id = getattr(version, "run_id", None)
    if not run_id:
        return None, "registered without a run, so without a lineage document"
    from mlflow.exceptions import MlflowException

    with tempfile.TemporaryDirectory(prefix="lineage-") as tmp:
        try:  # within LINEAGE_MAX_BYTES; one that cannot be fetched cannot be read: no score (fail closed)
            data = fetch_capped(client, run_id, LINEAGE_ARTIFACT, LINEAGE_MAX_BYTES, "its lineage document")
        except FileNotFoundError:
            return None, f"registered without a lineage document ({LINEAGE_ARTIFACT} is not in run {run_id})"
        except TooLarge as err:
            return None, str(err)
        except (OSError, MlflowException) as err:
            return None, f"its lineage document (run {run_id}) cannot be fetched: {reason(err)}"
        path = Path(tmp) / LINEAGE_ARTIFACT
        path.write_bytes(data)
        try:
            rewritten = check_lineage(client, version, path)  # tasks/register/manifest.py
        except UserError as err:  # its run's params cannot be read: nor can the document be trusted
            rewritten = one_line(str(err), limit=REASON_CHARS)
        if rewritten:
            return None, rewritten
        try:
            doc = json.loads(Path(path).read_text())
        except (OSError, ValueError) as err:
            return None, f"its lineage document (run {run_id}) cannot be read: {err}"
    if not isinstance(doc, dict):
        return None, f"its lineage document (run {run_id}) is not a JSON object"
    problem = _names_other(doc.get("model"), version, run_id)
    return (None, problem) if problem else (doc, "")


def _names_other(owner: Any, version: Any, run_id: str) -> str:
    """Why the document's `model` section does not name `version` ("" when it does): its model
    name, version and run id, and its source when recorded."""
    if not isinstance(owner, dict) or not {"name", "version", "run_id"} <= owner.keys():
        return (f"its lineage document (run {run_id}) does not name the version it belongs to "
                "(model.name, model.version, model.run_id)")
    said = (str(owner["name"]), str(owner["version"]), str(owner["run_id"]))
    if said != (version.name, str(version.version), run_id):
        return (f"the lineage document in run {run_id} describes {said[0]} v{said[1]} (run "
                f"{said[2]}), not this version ({version.name} v{version.version})")
    source = owner.get("source")
    if source is not None and source != version.source:
        return (f"the lineage document in run {run_id} describes {source}, not this version "
                f"({version.source})")
    return ""


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def tag_disagreements(tags: dict[str, str], metric: str, score: float | None,
                      protocol: str | None) -> list[str]:
    """Display tags that say something else than the lineage document (an absent tag says nothing)."""
    notes = []
    raw = tags.get(METRIC_TAG.format(metric))
    tagged = score_from_tags(tags, metric)
    if raw is not None and not (tagged is not None and score is not None
                                and math.isclose(tagged, score, rel_tol=1e-9, abs_tol=0.0)):
        notes.append(f"tag {METRIC_TAG.format(metric)}={raw} disagrees with its lineage document "
                     f"({metric}={score if score is not None else 'none'})")
    if "protocol" in tags and protocol_from_tags(tags) != protocol:
        notes.append(f"tag protocol={tags['protocol']} disagrees with its lineage document "
                     f"(protocol {protocol or 'unknown'})")
    return notes


def champion_of(client: Any, version: Any, metric: str) -> Champion:
    """`version` as the champion to beat: score and protocol from its lineage document."""
    doc, problem = read_lineage(client, version)
    tags = dict(version.tags or {})
    if doc is None:
        log.warning("%s v%s: %s; it has no score that can be read", version.name,
                    version.version, problem)
        # its family and task from its tags: they can only keep a candidate from being ranked against it
        told = Lineage(tags.get("family"), tags.get("task")) if "family" in tags else None
        return Champion(str(version.version), None, None, note=problem, lineage=told)
    score = _finite((doc.get("metrics") or {}).get(metric))
    protocol = (doc.get("protocol") or {}).get("id") or None
    notes = tag_disagreements(tags, metric, score, protocol)
    if notes:
        notes.append("the document is used")
        log.warning("%s v%s: %s", version.name, version.version, "; ".join(notes))
    return Champion(str(version.version), score, protocol, note="; ".join(notes), lineage=of_record(doc))


def holder(client: Any, model_name: str) -> Any | None:
    """The version holding `champion` now (None when the model or the alias does not exist)."""
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version_by_alias(model_name, CHAMPION)
    except MlflowException as err:
        if err.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            return None
        raise


def current_champion(client: Any, model_name: str, metric: str) -> Champion | None:
    """The champion now, scored from its lineage document (None: no champion)."""
    mv = holder(client, model_name)
    return None if mv is None else champion_of(client, mv, metric)


@dataclass(frozen=True)
class Move:
    """How a promoted version's move of `champion` ended."""

    holds: bool
    holder: str | None  # the version holding `champion` after the checks
    note: str = ""  # what happened when it was not a plain move, as recorded


def move_champion(client: Any, model_name: str, version: str, decided_against: str | None,
                  redecide: Callable[[Champion | None], Decision], metric: str) -> Move:
    """Move `champion` to `version` and read it back; against a holder that is neither this
    version nor the one it decided against, decide again (module docstring, the race rule)."""
    expected, notes = decided_against, []
    for attempt in range(MOVE_TRIES + 1):
        now = holder(client, model_name)
        held = None if now is None else str(now.version)
        if held == version:
            if expected not in (decided_against, None, version):
                _record(client, model_name, expected, "champion.displaced",
                        f"v{version} took champion from this version after a concurrent "
                        f"registration: {notes[-1]}")
            return Move(True, version, "; ".join(notes))
        if attempt == MOVE_TRIES:
            break
        if held != expected:  # moved since the decision: compare with the version holding it now
            again = redecide(None if now is None else champion_of(client, now, metric))
            if not again.promote:
                return _lost(client, model_name, version, held, again.reason)
            notes.append(f"v{held or 'none'} took champion meanwhile; decided again: {again.reason}")
            log.warning("%s v%s: %s", model_name, version, notes[-1])
            expected = held
        client.set_registered_model_alias(model_name, CHAMPION, version)
    return _lost(client, model_name, version, held,
                 f"the champion alias kept moving ({MOVE_TRIES} moves, each undone before it was read back)")


def _lost(client: Any, model_name: str, version: str, held: str | None, why: str) -> Move:
    text = f"v{held or 'none'} holds champion, moved there while this version was registered; {why}"
    log.warning("%s v%s lost the race for champion: %s", model_name, version, text)
    _record(client, model_name, version, "champion.lost_race", text)
    return Move(False, held, f"lost the race for champion: {text}")


def _record(client: Any, model_name: str, version: str | None, key: str, text: str) -> None:
    if version is not None:
        client.set_model_version_tag(model_name, version, key, text[:5000])


def rescored(client: Any, model_name: str, champion: Champion | None,
              rescore: dict[str, Any] | None, metric: str) -> tuple[Champion | None, dict[str, str]]:
    """The champion with its score under the current protocol, when the flow re-scored it
    (`rescore`: {"version", "report"}; the new score is also tagged on the champion's version),
    or with why it could not (`rescore`: {"version", "error"}, or a report without a finite score
    or a protocol): then the champion keeps what it had, and the new version's tag
    `champion.rescore_error` says why in one line. A re-score of a version that no longer holds
    `champion` is not used: the holder is compared by what its own lineage document says."""
    if champion is None or not rescore or str(rescore.get("version")) != champion.version:
        return champion, {}
    error = _rescore_problem(rescore, metric)
    if error:  # the flow tried and failed: the champion keeps what it had
        log.warning("%s v%s could not be re-scored: %s", model_name, champion.version, error)
        note = "; ".join(filter(None, [champion.note, f"re-scoring it failed: {error}"]))
        return (Champion(champion.version, champion.score, champion.protocol, note=note, lineage=champion.lineage),
                {"champion.rescore_error": error})
    report = rescore["report"]
    score = float(report["metrics"][metric])
    protocol = str(report["protocol"]["id"])
    text = (f"v{champion.version} re-scored under protocol {protocol}: {metric}={score:.6g} "
            f"(was {champion.score if champion.score is not None else 'none'} under "
            f"{champion.protocol or 'unknown'}; {report.get('seconds_total', '?')} s)")
    client.set_model_version_tag(model_name, champion.version, f"rescore.{protocol}",
                                 f"{metric}={score:.6g}")
    log.info("%s", text)
    return (Champion(champion.version, score, protocol, note=champion.note, lineage=champion.lineage),
            {"champion.rescored": text})


def _rescore_problem(rescore: dict[str, Any], metric: str) -> str:
    """Why the flow's re-score gives the champion no score, in one short line ("": it does)."""
    if rescore.get("error"):
        return one_line(str(rescore["error"]), limit=REASON_CHARS)
    report = rescore.get("report")
    if not isinstance(report, dict):
        return "the re-score gave no report"
    metrics, protocol = report.get("metrics"), report.get("protocol")
    score = metrics.get(metric) if isinstance(metrics, dict) else None
    if _finite(score) is None:
        return one_line(f"the re-score's report has no finite {metric} ({score!r})", limit=REASON_CHARS)
    if not isinstance(protocol, dict) or not protocol.get("id"):
        return "the re-score's report names no evaluation protocol"
    return ""
