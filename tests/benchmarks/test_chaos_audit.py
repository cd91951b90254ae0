"""The chaos run's audit (benchmarks/chaos/audit.py) on a registry made up in memory."""
from __future__ import annotations

from benchmarks.chaos.audit import Registry, summarize


def _version(fp: str, status: str = "READY", problems: list[str] | None = None) -> dict:
    return {"status": status, "run_id": "r", "fingerprint": fp, "problems": problems or []}


def _run(number: int, fp: str, state: str = "Completed", candidate: str | None = None,
         recovery: float | None = 10.0) -> dict:
    return {"run": number, "killed": "x", "rerun_state": state, "fingerprint": fp,
            "candidate_fingerprint": candidate or fp, "recovery_s": recovery}


def test_a_clean_registry_has_nothing_to_report() -> None:
    reg = Registry({"1": _version("a"), "2": _version("b")}, {"candidate": "2"})
    summary = summarize([_run(1, "a", candidate="a"), _run(2, "b", recovery=31.25)], reg)
    assert (summary["lost"], summary["duplicated"], summary["half_registered"],
            summary["candidate_behind"]) == ([], {}, [], [])
    assert summary["versions"] == 2 and summary["kills"] == 2
    assert summary["longest_recovery_s"] == 31.2


def test_lost_duplicated_half_registered_and_behind_are_each_found() -> None:
    reg = Registry({"1": _version("a"), "2": _version("a"),
                    "3": _version("c", status="PENDING_REGISTRATION"),
                    "4": _version("d", problems=["no MLmodel"])},
                   {"candidate": "4", "champion": "9"}, [("run-id", "finetune-1")])
    runs = [_run(1, "a"), _run(2, "b"), _run(3, "c", candidate="a"), _run(4, "e", state="Failed")]
    summary = summarize(runs, reg)
    assert summary["lost"] == [2]  # run 4's rerun failed: not counted as lost, but as failed
    assert summary["reruns_failed"] == [4]
    assert summary["duplicated"] == {"a": 2}
    assert summary["half_registered"] == [
        "v3: PENDING_REGISTRATION", "v4: no MLmodel", "alias champion -> missing v9",
        "run run-id (finetune-1) left RUNNING"]
    assert summary["candidate_behind"] == [3]
