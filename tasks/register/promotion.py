"""Champion/challenger: does the new version take the `champion` alias? (pure, no MLflow)

Rule: the evaluation gate must pass, AND the candidate must beat the current champion on
`register.primary_metric` in the direction `register.primary_metric_goal`. Strictly better: a tie
keeps the champion (re-registering the same model does not move the alias). With no champion yet,
passing the gate is enough. Promotion fails closed: a champion whose score cannot be read (no
readable lineage document, one that does not name its version, no score for the metric) and that
was not re-scored holds the alias; the reason says why (with the re-score's error when the flow
tried one), and the way out: re-score it, or move `champion` by hand once it is checked.

Scores are compared only under the same evaluation protocol (tasks/evaluate/protocol.py: the
encoders, prompts, seeds, sizes, data, backend and precision they were measured with). A champion
scored under another protocol is not compared with: the flow re-scores it under the current
protocol first (flows/rescore.py) and passes that score in; without one, the candidate is not
promoted and the reason says the champion must be re-scored.
Scores are compared only within one lineage (tasks/register/naming.py): a champion of another model
family, or trained for another task (text-to-image, edit), is never ranked against, whatever the
protocol: the candidate is not promoted, the champion holds, and the reason says so in one line.
Scores from random-weight encoders (`uncalibrated`) promote only with
`register.promote_uncalibrated: true`, an explicit choice (the offline demo makes it).

The champion's score and protocol are read from its lineage document, never from its tags
(tasks/register/registry.py); a champion without a readable document has no score, and a tag that
disagrees with the document is named at the end of the reason (`Champion.note`).

The decision is written on the new version (tag `champion.decision`, the end of its description)
and, with both scores and the champion compared against, in its lineage.json.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from tasks.common.errors import UserError
from tasks.register.lineage import Evaluation
from tasks.register.naming import Lineage

Goal = Literal["maximize", "minimize"]

#: Version tag holding a metric's value (tasks/register/lineage.py writes `metric.<name>`).
METRIC_TAG = "metric.{}"


@dataclass(frozen=True)
class Champion:
    """The version holding `champion` now, with its score on the primary metric (None: unknown)."""

    version: str
    score: float | None
    protocol: str | None = None  # the protocol id its score was measured under
    #: why it has no score, or which of its tags disagreed with its lineage document
    #: (tasks/register/registry.py reads both from the document); said in the decision
    note: str = ""
    #: its family and task as its lineage document records them (None: not read)
    lineage: Lineage | None = None


@dataclass(frozen=True)
class Decision:
    promote: bool
    reason: str
    metric: str
    candidate_score: float
    champion: Champion | None

    def tags(self) -> dict[str, str]:
        """What is recorded on the new version."""
        note = {"champion.previous_note": self.champion.note} if self.champion and self.champion.note else {}
        return {**note,
            "champion.decision": self.reason,
            "champion.promoted": str(self.promote).lower(),
            "champion.primary_metric": self.metric,
            "champion.candidate_score": repr(self.candidate_score),
            "champion.previous_version": self.champion.version if self.champion else "none",
            "champion.previous_score": (
                repr(self.champion.score)
                if self.champion and self.champion.score is not None else "none"
            ),
            "champion.previous_protocol": (self.champion.protocol or "unknown"
                                           if self.champion else "none"),
            **({"champion.previous_lineage": self.champion.lineage.says()}
               if self.champion and self.champion.lineage else {}),
        }


def candidate_score(evaluation: Evaluation, metric: str) -> float:
    """The candidate's score; a missing or non-finite metric is a config/report error."""
    if metric not in evaluation.metrics:
        known = ", ".join(sorted(evaluation.metrics)) or "(none)"
        raise UserError(
            f"register.primary_metric is '{metric}', but the evaluation report has no such "
            f"metric. Set register.primary_metric in params.yaml to one of: {known}"
        )
    score = evaluation.metrics[metric]
    if not math.isfinite(score):
        raise UserError(f"the evaluation's {metric} is {score}: cannot rank the model on it")
    return score


def protocol_from_tags(tags: dict[str, str]) -> str | None:
    """The protocol id of a version's `protocol` tag (`<id> (calibrated)`), None when absent."""
    raw = tags.get("protocol", "")
    first = raw.split(" ")[0] if raw else ""
    return first if first and first != "unknown" else None


def score_from_tags(tags: dict[str, str], metric: str) -> float | None:
    raw = tags.get(METRIC_TAG.format(metric))
    try:
        value = float(raw) if raw is not None else None
    except ValueError:
        return None
    return value if value is not None and math.isfinite(value) else None


def unscored(champion: Champion, metric: str, fmt: str) -> str:
    """Why a champion without a readable score holds (fail closed), and the way out."""
    return (f"not promoted: champion v{champion.version} holds, its {metric} score cannot be "
            f"read or re-scored ({champion.note or 'no score'}); re-score it (the flow does when "
            f"it can) or move the champion alias by hand once it is checked ({fmt})")


def other_lineage(champion: Champion | None, lineage: Lineage | None) -> bool:
    """True when `champion` is of another family or task than `lineage` (both known)."""
    return (champion is not None and champion.lineage is not None and lineage is not None
            and lineage.differs(champion.lineage))


def not_ranked(champion: Champion, lineage: Lineage, fmt: str) -> str:
    """The one-line reason of a candidate of another lineage than the champion's."""
    assert champion.lineage is not None
    own = lineage.default_name()
    return (f"not ranked: champion v{champion.version} is {champion.lineage.says()}, this version "
            f"{lineage.says()}, so their scores are not compared and the champion holds; register it under "
            f"its own name: {f'unset register.model_name (then {own})' if own else 'set register.model_name'}"
            f" ({fmt})")


def decide(evaluation: Evaluation, metric: str, goal: Goal, champion: Champion | None,
           promote_uncalibrated: bool = False, lineage: Lineage | None = None) -> Decision:
    """`lineage`: the candidate's family and task; a champion of another is never ranked against."""
    score = candidate_score(evaluation, metric)
    fmt = f"{metric}={score:.6g}"
    mine = evaluation.protocol_id
    if other_lineage(champion, lineage):
        assert champion is not None and lineage is not None
        return Decision(False, not_ranked(champion, lineage, fmt), metric, score, champion)
    if not evaluation.passed:
        promote, reason = False, f"not promoted: the evaluation gate did not pass ({fmt})"
    elif evaluation.uncalibrated and not promote_uncalibrated:
        promote, reason = False, (
            f"not promoted: the scores are uncalibrated (random-weight built-in encoders) and "
            f"register.promote_uncalibrated is false ({fmt})")
    elif champion is not None and champion.score is not None and champion.protocol != mine:
        promote, reason = False, (
            f"not promoted: champion v{champion.version} was scored under evaluation protocol "
            f"{champion.protocol or 'unknown'}, this version under {mine or 'unknown'}; the scores "
            f"are not comparable until the champion is re-scored under {mine or 'unknown'} ({fmt})")
    elif champion is None:
        promote, reason = True, f"promoted: the gate passed and there was no champion ({fmt})"
    elif champion.score is None:
        return Decision(False, unscored(champion, metric, fmt), metric, score, champion)
    else:
        better = score > champion.score if goal == "maximize" else score < champion.score
        versus = f"{fmt} vs champion v{champion.version} {metric}={champion.score:.6g}, {goal}"
        promote = better
        reason = (f"promoted: the gate passed and it beats the champion ({versus})" if better
                  else f"not promoted: the gate passed but it does not beat the champion ({versus})")
        if mine:
            reason += f" under protocol {mine}"
    if promote and evaluation.uncalibrated:
        reason += " on uncalibrated scores (register.promote_uncalibrated: true)"
    if champion is not None and champion.note:
        reason += f"; champion v{champion.version}: {champion.note}"
    return Decision(promote, reason, metric, score, champion)
