"""Champion/challenger decision (pure): gate AND strictly better on the primary metric."""
from __future__ import annotations

import pytest

from tasks.common.errors import UserError
from tasks.register.lineage import Evaluation
from tasks.register.promotion import Champion, decide, score_from_tags

pytestmark = pytest.mark.quick  # make test-fast


def _ev(dino: float, passed: bool = True) -> Evaluation:
    return Evaluation(metrics={"dino": dino, "clip_i": 0.9}, passed=passed)


def test_first_model_that_passes_the_gate_becomes_champion() -> None:
    d = decide(_ev(0.5), "dino", "maximize", None)
    assert d.promote and d.reason == "promoted: the gate passed and there was no champion (dino=0.5)"
    assert d.tags()["champion.previous_version"] == "none"


def test_failed_gate_never_promotes_even_when_better() -> None:
    d = decide(_ev(0.9, passed=False), "dino", "maximize", Champion("1", 0.1))
    assert not d.promote and d.reason.startswith("not promoted: the evaluation gate did not pass")


@pytest.mark.parametrize(("score", "goal", "promote"), [
    (0.51, "maximize", True), (0.5, "maximize", False), (0.49, "maximize", False),
    (0.49, "minimize", True), (0.5, "minimize", False), (0.51, "minimize", False),
])
def test_candidate_must_strictly_beat_the_champion(score: float, goal: str, promote: bool) -> None:
    d = decide(_ev(score), "dino", goal, Champion("3", 0.5))  # type: ignore[arg-type]
    assert d.promote is promote
    assert f"dino={score:.6g} vs champion v3 dino=0.5, {goal}" in d.reason
    tags = d.tags()
    assert tags["champion.candidate_score"] == repr(score)
    assert tags["champion.previous_score"] == "0.5" and tags["champion.previous_version"] == "3"
    assert tags["champion.promoted"] == str(promote).lower()
    assert tags["champion.primary_metric"] == "dino"


def test_champion_without_a_score_holds_and_the_reason_says_why() -> None:
    """Fail closed: a champion whose score cannot be read is not replaced, however good the
    candidate; the reason names the problem and the way out."""
    d = decide(_ev(0.99), "dino", "maximize", Champion("2", None, note="its lineage document is gone"))
    assert not d.promote and d.reason == (
        "not promoted: champion v2 holds, its dino score cannot be read or re-scored (its lineage "
        "document is gone); re-score it (the flow does when it can) or move the champion alias by "
        "hand once it is checked (dino=0.99)")
    assert d.tags()["champion.previous_score"] == "none"
    assert d.tags()["champion.previous_note"] == "its lineage document is gone"


def test_a_champion_whose_rescore_failed_holds_and_the_candidate_records_why() -> None:
    """The flow could not re-score an unscored champion (flows/finetune.py hands the error on):
    the decision and the candidate's tag `champion.rescore_error` say so."""
    from tasks.register.registry import rescored

    unread = Champion("2", None, note="registered without a lineage document")
    champion, tags = rescored(None, "sd", unread, {"version": "2", "error": "no openvino/ in v2"}, "dino")
    assert tags == {"champion.rescore_error": "no openvino/ in v2"}
    d = decide(_ev(0.99), "dino", "maximize", champion)
    assert not d.promote and ("(registered without a lineage document; re-scoring it failed: no "
                              "openvino/ in v2)") in d.reason


def test_unknown_primary_metric_names_the_key_and_the_choices() -> None:
    with pytest.raises(UserError, match=r"register.primary_metric is 'fid'.*one of: clip_i, dino"):
        decide(_ev(0.2), "fid", "maximize", None)


def test_score_from_tags() -> None:
    assert score_from_tags({"metric.dino": "0.25"}, "dino") == 0.25
    assert score_from_tags({"metric.dino": "nan"}, "dino") is None
    assert score_from_tags({}, "dino") is None


def _proto(dino: float, pid: str = "p1", calibrated: bool = True, passed: bool = True) -> Evaluation:
    protocol = {"id": pid, "calibrated": calibrated,
                "uncalibrated_reason": None if calibrated else "uncalibrated scores: builtin:tiny-clip"}
    return Evaluation(metrics={"dino": dino}, passed=passed, protocol=protocol)


def test_a_better_challenger_under_the_same_protocol_wins() -> None:
    d = decide(_proto(0.6), "dino", "maximize", Champion("1", 0.5, protocol="p1"))
    assert d.promote and d.reason.endswith("under protocol p1")
    d = decide(_proto(0.4), "dino", "maximize", Champion("1", 0.5, protocol="p1"))
    assert not d.promote


def test_a_champion_scored_under_another_protocol_is_not_compared() -> None:
    """Switching encoders lowers every score: the old champion's number is no yardstick."""
    d = decide(_proto(0.3, pid="real"), "dino", "maximize", Champion("1", 0.9, protocol="tiny"))
    assert not d.promote
    assert ("champion v1 was scored under evaluation protocol tiny, this version under real; "
            "the scores are not comparable until the champion is re-scored") in d.reason
    assert d.tags()["champion.previous_protocol"] == "tiny"
    d = decide(_proto(0.95, pid="real"), "dino", "maximize", Champion("1", 0.9, protocol=None))
    assert not d.promote and "protocol unknown" in d.reason


def test_uncalibrated_scores_promote_only_when_the_setting_says_so() -> None:
    d = decide(_proto(0.9, calibrated=False), "dino", "maximize", None)
    assert not d.promote and "uncalibrated" in d.reason and "promote_uncalibrated is false" in d.reason
    d = decide(_proto(0.9, calibrated=False), "dino", "maximize", None, promote_uncalibrated=True)
    assert d.promote and d.reason.endswith("on uncalibrated scores (register.promote_uncalibrated: true)")


def test_protocol_from_tags() -> None:
    from tasks.register.promotion import protocol_from_tags

    assert protocol_from_tags({"protocol": "abc123 (uncalibrated)"}) == "abc123"
    assert protocol_from_tags({"protocol": "unknown (the report has no protocol section)"}) is None
    assert protocol_from_tags({}) is None
