"""One registered model per lineage of comparable models (tasks/register/naming.py), the guard that
keeps another family's or task's version from being ranked against a champion, and text stored in
tags in one line (tasks/register/oneline.py)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from flows.rescore import needs_rescore
from tasks.common.errors import UserError
from tasks.register.lineage import Evaluation
from tasks.register.naming import EDIT, TEXT_TO_IMAGE, Lineage, model_name, of_record, of_training, planned
from tasks.register.oneline import last_error, one_line
from tasks.register.promotion import Champion, decide


@pytest.mark.quick  # make test-fast
def test_the_name_follows_what_was_trained() -> None:
    assert of_training({"family": "sd", "method": "dreambooth"}).default_name() == "sd-dreambooth"
    assert of_training({"family": "zimage", "method": "lora"}).default_name() == "zimage-lora"
    assert of_training({"family": "kontext", "method": "lora", "edit_pairs": 4}).default_name() == "kontext-edit-lora"
    assert of_training({"family": "sd", "method": "textual_inversion"}).default_name() == "sd-textual-inversion"
    assert of_training({"family": "qwenimage-edit", "method": "lora", "edit_pairs": 2}).default_name() \
        == "qwenimage-edit-lora"
    assert model_name("sd-finetuned", of_training({"family": "zimage", "method": "lora"})) == "sd-finetuned"
    with pytest.raises(UserError, match=r"register.model_name is not set .*\(family unknown"):
        model_name(None, Lineage(None, None, "lora"))


@pytest.mark.quick  # make test-fast
def test_the_planned_name_reads_params_and_the_train_report(tmp_path: Path) -> None:
    params = tmp_path / "params.yaml"
    params.write_text("base:\n  model: builtin:tiny-zimage\ntrain:\n  method: lora\nregister:\n  model_name: null\n")
    report = tmp_path / "train.json"
    assert planned(params, report, None) == "zimage-lora"  # before the stages: params.yaml
    report.write_text(json.dumps({"family": "zimage", "method": "lora", "edit_pairs": 2}))
    assert planned(params, report, None) == "zimage-edit-lora"  # after: what trained
    report.write_text(json.dumps({"family": "sd", "method": "dreambooth"}))  # stale: params changed since
    assert planned(params, report, None) == "zimage-lora"
    params.write_text("base:\n  model: org/some-hub-model\ntrain:\n  method: lora\n")
    assert planned(params, None, tmp_path / "models/base") is None  # a hub base not downloaded: not known
    params.write_text("register:\n  model_name: sd-finetuned\n")
    assert planned(params, report, None) == "sd-finetuned"  # set by hand: kept


@pytest.mark.quick  # make test-fast
def test_a_champion_of_another_family_or_task_is_never_ranked_against() -> None:
    better = Evaluation(metrics={"dino": 0.9}, passed=True, protocol={"id": "p", "calibrated": True})
    sd = Champion("1", 0.2, "p", lineage=Lineage("sd", TEXT_TO_IMAGE, "dreambooth"))
    zimage = Lineage("zimage", TEXT_TO_IMAGE, "lora")
    decision = decide(better, "dino", "maximize", sd, lineage=zimage)
    assert not decision.promote
    assert decision.reason == (
        "not ranked: champion v1 is sd text-to-image, this version zimage text-to-image, so their scores are "
        "not compared and the champion holds; register it under its own name: unset register.model_name "
        "(then zimage-lora) (dino=0.9)")
    assert decision.tags()["champion.previous_lineage"] == "sd text-to-image"
    edit = decide(better, "dino", "maximize", sd, lineage=Lineage("sd", EDIT, "lora"))
    assert not edit.promote and "this version sd edit" in edit.reason
    # the same lineage is ranked as before; a champion whose lineage is unknown too
    assert decide(better, "dino", "maximize", sd, lineage=Lineage("sd", TEXT_TO_IMAGE, "lora")).promote
    assert decide(better, "dino", "maximize", Champion("1", 0.2, "p"), lineage=zimage).promote
    # and another lineage's champion is never re-scored on this version's evaluation
    under_old = Champion("1", 0.2, "old", lineage=sd.lineage)
    assert needs_rescore(under_old, {"protocol": {"id": "p"}}, Lineage("sd", TEXT_TO_IMAGE))
    assert not needs_rescore(under_old, {"protocol": {"id": "p"}}, zimage)


@pytest.mark.quick  # make test-fast
def test_a_version_registered_before_the_lineage_section_has_one_from_its_document() -> None:
    old = {"params": {"base": {"model": "builtin:tiny-sd"}, "train": {"method": "dreambooth"}}}
    assert of_record(old) == Lineage("sd", None, "dreambooth")
    assert of_record({**old, "train": {"method": "lora", "edit_pairs": 3}}) == Lineage("sd", EDIT, "lora")
    assert of_record({"lineage": {"family": "kontext", "task": EDIT, "method": "lora"}}).says() == "kontext edit"


@pytest.mark.quick  # make test-fast
def test_an_error_stored_in_a_tag_is_one_line_without_log_prefixes() -> None:
    output = ("10:41:02 INFO tasks.evaluate: loading models/base\n"
              "10:41:09 WARNING tasks.evaluate: 3 prompts\n"
              "error: evaluate.edits: the edit set's targets have reference images, but Stable Diffusion 1.x/2.x "
              "does not take reference images; set evaluate.edits.enabled: false\n"
              "DVC removed this stage's outputs; `dvc checkout` brings the last good ones back\n")
    assert last_error(output) == ("evaluate.edits: the edit set's targets have reference images, but Stable "
                                  "Diffusion 1.x/2.x does not take reference images; set evaluate.edits.enabled: false")
    assert last_error("12:00:01.532 | ERROR   | prefect.task_runs - boom\n") == "boom"
    text = one_line("re-scoring models:/m/1 failed (exit 2):\n10:41:02 INFO tasks.evaluate: loading\n  it broke\n")
    assert text == "re-scoring models:/m/1 failed (exit 2): loading it broke"
    assert len(one_line("x" * 5000)) == 1000 and "\n" not in one_line("a\n" * 3000)


def test_a_zimage_fine_tune_is_never_ranked_against_the_sd_champion(project: Path) -> None:
    """Under a name set by hand and shared: the champion holds, the decision says why in one line and
    the champion is not re-scored on the candidate's yardstick; unset, the name follows the family."""
    import mlflow

    from tasks.register.core import register

    def registration(report: dict, scores: dict, **kwargs):
        (project / "reports/train.json").write_text(json.dumps(report))
        (project / "reports/evaluate.json").write_text(json.dumps(
            {"metrics": scores, "gate": {"passed": True, "checks": {}}}))
        return register(project / "models/finetuned", project / "models/openvino", project / "reports/evaluate.json",
                        project / "dvc.lock", project / "params.yaml", train_report=project / "reports/train.json",
                        **kwargs)

    sd = {"method": "dreambooth", "family": "sd", "steps": 3}
    assert registration(sd, {"dino": 0.2}).champion_moved
    zimage = {"method": "lora", "family": "zimage", "lora_type": "lora", "steps": 3}
    failed = ("re-scoring models:/sd-test/1 failed (exit 2):\n10:41:02 INFO tasks.evaluate: loading\n"
              "error: evaluate.edits: set evaluate.edits.enabled: false")
    second = registration(zimage, {"dino": 0.9}, champion_rescore={"version": "1", "error": failed})
    client = mlflow.MlflowClient()
    mv = client.get_model_version("sd-test", second.version)
    assert not second.champion_moved and str(client.get_model_version_by_alias("sd-test", "champion").version) == "1"
    decision = mv.tags["champion.decision"]
    assert decision.startswith("not ranked: champion v1 is sd text-to-image, this version zimage text-to-image")
    assert "\n" not in decision and "champion.rescore_error" not in mv.tags  # never re-scored for it
    assert "\n" not in mv.description.split("\n\n")[0] and decision in mv.description
    assert (mv.tags["family"], mv.tags["task"]) == ("zimage", "text-to-image")
    # left unset, the name follows what was trained: a lineage of its own, where it is champion
    (project / "params.yaml").write_text("train:\n  max_train_steps: 3\nregister:\n  model_name: null\n")
    third = registration(zimage, {"dino": 0.9})
    assert third.name == "zimage-lora" and third.champion_moved
