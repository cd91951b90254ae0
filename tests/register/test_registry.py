"""What promotion reads from a real MLflow registry (a SQLite store in tmp): the champion's score
from its lineage document, never its tags, and the champion move read back after it is made.
Versions are made by hand, as tasks/register leaves them (lineage.json in the version's run)."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import mlflow
import pytest

from tasks.register.lineage import Evaluation
from tasks.register.promotion import Champion, Decision, decide
from tasks.register.registry import CHAMPION, current_champion, move_champion

pytestmark = pytest.mark.quick  # make test-fast

NAME = "sd-test"


def _version(client: Any, tmp_path: Path, dino: float | None, protocol: str = "p1",
             tags: dict[str, str] | None = None) -> str:
    """A version whose run holds lineage.json with `dino` (None: a run without the document)."""
    run = client.create_run(client.get_experiment_by_name("Default").experiment_id).info.run_id
    source = str(tmp_path / run)
    if not client.search_registered_models(f"name='{NAME}'"):
        client.create_registered_model(NAME)
    version = str(client.create_model_version(NAME, source=source, run_id=run, tags=tags or {}).version)
    if dino is not None:
        client.log_dict(run, {"metrics": {"dino": dino}, "protocol": {"id": protocol}, "model": {
            "name": NAME, "version": version, "run_id": run, "source": source}}, "lineage.json")
    return version


def _challenger(dino: float):
    evaluation = Evaluation(metrics={"dino": dino}, passed=True, protocol={"id": "p1"})

    def redecide(champion: Champion | None) -> Decision:
        return decide(evaluation, "dino", "maximize", champion)
    return redecide


def _champion_holders(client: Any) -> list[str]:
    """Every version that lists `champion` among its aliases (search results carry no aliases)."""
    versions = [str(v.version) for v in client.search_model_versions(f"name='{NAME}'")]
    return [v for v in versions if CHAMPION in client.get_model_version(NAME, v).aliases]


def test_the_champions_score_comes_from_its_lineage_document(tmp_path: Path) -> None:
    """Tags forged to keep the champion (a high score, a link to another run's document) are
    named and overruled; the better challenger wins."""
    client = mlflow.MlflowClient()
    decoy = client.create_run(client.get_experiment_by_name("Default").experiment_id).info.run_id
    client.log_dict(decoy, {"metrics": {"dino": 99.0}, "protocol": {"id": "p1"}}, "lineage.json")
    v1 = _version(client, tmp_path, 0.4, tags={"metric.dino": "99.0", "protocol": "p1 (calibrated)",
                                                "lineage": f"runs:/{decoy}/lineage.json"})
    client.set_registered_model_alias(NAME, CHAMPION, v1)
    champion = current_champion(client, NAME, "dino")
    assert champion == Champion(v1, 0.4, "p1", note=(
        "tag metric.dino=99.0 disagrees with its lineage document (dino=0.4); the document is used"))
    decision = _challenger(0.45)(champion)
    assert decision.promote
    assert decision.reason == (
        "promoted: the gate passed and it beats the champion (dino=0.45 vs champion v1 dino=0.4, "
        "maximize) under protocol p1; champion v1: tag metric.dino=99.0 disagrees with its lineage "
        "document (dino=0.4); the document is used")
    assert decision.tags()["champion.previous_note"] == champion.note


def test_a_champion_without_a_lineage_document_holds(tmp_path: Path) -> None:
    """Fail closed: a champion whose score cannot be read is not replaced by a candidate that
    passed the gate; the reason says why and the way out."""
    client = mlflow.MlflowClient()
    v1 = _version(client, tmp_path, None, tags={"metric.dino": "99.0"})
    client.set_registered_model_alias(NAME, CHAMPION, v1)
    champion = current_champion(client, NAME, "dino")
    run_id = client.get_model_version(NAME, v1).run_id
    assert (champion.score, champion.protocol) == (None, None)
    decision = _challenger(0.9)(champion)
    assert not decision.promote and decision.reason == (
        "not promoted: champion v1 holds, its dino score cannot be read or re-scored (registered "
        f"without a lineage document (lineage.json is not in run {run_id})); re-score it (the flow "
        "does when it can) or move the champion alias by hand once it is checked (dino=0.9)")
    assert decision.tags()["champion.promoted"] == "false"


def test_a_lineage_document_must_name_the_version_it_belongs_to(tmp_path: Path) -> None:
    """A forged document that names no version (`{"metrics": {"dino": 99}}`), one of another
    version of the same run's model, or of another model's source, scores nothing: the champion
    has no score (and holds, above)."""
    client = mlflow.MlflowClient()
    v1, v2 = _version(client, tmp_path, 0.9), _version(client, tmp_path, 0.2)
    mv = client.get_model_version(NAME, v1)
    v2_run = client.get_model_version(NAME, v2).run_id
    client.set_registered_model_alias(NAME, CHAMPION, v1)
    owner = {"name": NAME, "version": v1, "run_id": mv.run_id}
    for doc, why in [
        ({"metrics": {"dino": 99}}, f"its lineage document (run {mv.run_id}) does not name the version it "
                                    "belongs to (model.name, model.version, model.run_id)"),
        ({"model": {**owner, "version": v2}}, f"the lineage document in run {mv.run_id} describes "
                                              f"{NAME} v{v2} (run {mv.run_id}), not this version ({NAME} v{v1})"),
        ({"model": {**owner, "run_id": v2_run}}, f"the lineage document in run {mv.run_id} describes "
                                                 f"{NAME} v{v1} (run {v2_run}), not this version ({NAME} v{v1})"),
        ({"model": {**owner, "source": "models:/m-other"}},
         f"the lineage document in run {mv.run_id} describes models:/m-other, not this version ({mv.source})"),
    ]:
        client.log_dict(mv.run_id, {"metrics": {"dino": 99.0}, "protocol": {"id": "p1"}, **doc}, "lineage.json")
        champion = current_champion(client, NAME, "dino")
        assert (champion.score, champion.note) == (None, why)
    client.log_dict(mv.run_id, {"metrics": {"dino": 0.9}, "protocol": {"id": "p1"}, "model": owner},
                    "lineage.json")
    assert current_champion(client, NAME, "dino") == Champion(v1, 0.9, "p1")


class RacingClient(mlflow.MlflowClient):
    """The real client; right after this registration's first move of `champion`, another
    registration moves it to `rival` (the race, made deterministic)."""

    rival: str | None = None

    def set_registered_model_alias(self, name: str, alias: str, version: Any) -> None:
        super().set_registered_model_alias(name, alias, version)
        if alias == CHAMPION and self.rival is not None:
            rival, self.rival = self.rival, None
            super().set_registered_model_alias(name, alias, rival)


def test_a_registration_beaten_in_a_race_keeps_candidate_and_a_record(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """v2 (0.5) and v3 (0.6) both decided against v1 (0.4); v3 moved champion between v2's move
    and v2's read-back: v2 decides again against v3, loses, and says so."""
    client = RacingClient()
    v1, v2, v3 = (_version(client, tmp_path, d) for d in (0.4, 0.5, 0.6))
    client.set_registered_model_alias(NAME, CHAMPION, v1)
    client.rival = v3
    with caplog.at_level(logging.WARNING, logger="tasks.register.registry"):
        move = move_champion(client, NAME, v2, v1, _challenger(0.5), "dino")
    assert (move.holds, move.holder) == (False, v3)
    assert _champion_holders(client) == [v3]
    record = client.get_model_version(NAME, v2).tags["champion.lost_race"]
    assert record == (f"v{v3} holds champion, moved there while this version was registered; "
                      "not promoted: the gate passed but it does not beat the champion (dino=0.5 "
                      f"vs champion v{v3} dino=0.6, maximize) under protocol p1")
    assert move.note == f"lost the race for champion: {record}"
    assert f"v{v2} lost the race for champion: v{v3} holds champion" in caplog.text


def test_a_registration_that_beats_the_racer_moves_again_and_records_it(tmp_path: Path) -> None:
    """v3 (0.6) moved champion, and a worse concurrent registration v2 (0.5) moved it before v3
    read it back: v3 decides again, wins, moves again, and v2 carries the record."""
    client = RacingClient()
    v1, v2, v3 = (_version(client, tmp_path, d) for d in (0.4, 0.5, 0.6))
    client.set_registered_model_alias(NAME, CHAMPION, v1)
    client.rival = v2
    move = move_champion(client, NAME, v3, v1, _challenger(0.6), "dino")
    assert (move.holds, move.holder) == (True, v3)
    assert _champion_holders(client) == [v3]
    assert move.note.startswith(f"v{v2} took champion meanwhile; decided again: promoted: the gate "
                                f"passed and it beats the champion (dino=0.6 vs champion v{v2} dino=0.5")
    assert client.get_model_version(NAME, v2).tags["champion.displaced"] == (
        f"v{v3} took champion from this version after a concurrent registration: {move.note}")


def test_a_champion_moved_since_the_decision_is_compared_before_moving(tmp_path: Path) -> None:
    """Read before the move too: v3 (0.6) took champion after v2 (0.5) decided against v1;
    v2 never moves it."""
    client = mlflow.MlflowClient()
    v1, v2, v3 = (_version(client, tmp_path, d) for d in (0.4, 0.5, 0.6))
    client.set_registered_model_alias(NAME, CHAMPION, v3)
    move = move_champion(client, NAME, v2, v1, _challenger(0.5), "dino")
    assert not move.holds and _champion_holders(client) == [v3]
    assert "champion.lost_race" in client.get_model_version(NAME, v2).tags
