"""A champion whose re-score fails, for whatever reason, holds; the candidate is still registered,
with the reason in one short line (flows/rescore.py `attempt`, tasks/register/registry.py `rescored`).

Against a real local MLflow store (tests/conftest.py) and a champion registered from the tiny models
(tests/register/conftest.py); the evaluate command is a small script standing in for dvc.yaml's."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from urllib.parse import urlparse

import mlflow
import pytest
from mlflow.exceptions import MlflowException

from flows.rescore import RESCORE_TAG, attempt
from tasks.common.tracking import PARENT_ENV
from tasks.register.core import register
from tests.register.conftest import EVAL_PASS

#: What dvc.yaml's evaluate command becomes here: it fails as RESCORE_MODE says.
EVALUATE = """\
import os, signal, subprocess, sys, time
mode = os.environ["RESCORE_MODE"]
print("10:41:02 INFO tasks.evaluate: loading the champion", flush=True)
print("2026-11-29 10:41:03,532 WARNING tasks.evaluate: 3 prompts", file=sys.stderr, flush=True)
if mode == "crash":
    raise RuntimeError("the denoiser's weights do not match this family")
if mode == "killed":
    os.kill(os.getpid(), signal.SIGKILL)
if mode in ("run-hang", "run-exit"):  # as tasks.evaluate does: its stage run, child of the flow's
    from tasks.common.tracking import stage_run
    with stage_run("evaluate"):
        print("scoring", flush=True)
        if mode == "run-exit":
            os._exit(3)  # dies without ending its run
        time.sleep(120)
if mode == "hang":
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    open("grandchild.pid", "w").write(str(child.pid))
    time.sleep(120)
# "silent": exits 0 and writes no report
"""

_LOG_PREFIX = re.compile(r"\d\d:\d\d:\d\d")


@pytest.fixture
def champion(project: Path) -> Path:
    """sd-test v1 holds champion, scored under protocol 'old'; the workspace's evaluate command is
    EVALUATE, and its report is a candidate's under protocol 'new' (so the champion needs a re-score)."""
    _report(project, "old", 0.2)
    assert register(*_args(project)).champion_moved
    (project / "evaluate.py").write_text(EVALUATE)
    (project / "dvc.yaml").write_text(
        "stages:\n  evaluate:\n    cmd: python evaluate.py --model models/finetuned --export models/openvino"
        " --report reports/evaluate.json\n")
    _report(project, "new", 0.9)
    return project


def _report(project: Path, protocol: str, dino: float) -> None:
    report = {**EVAL_PASS, "metrics": {**EVAL_PASS["metrics"], "dino": dino},
              "protocol": {"id": protocol, "calibrated": True}}
    (project / "reports/evaluate.json").write_text(json.dumps(report))


def _args(project: Path) -> tuple[Path, ...]:
    return (project / "models/finetuned", project / "models/openvino", project / "reports/evaluate.json",
            project / "dvc.lock", project / "params.yaml")


def _alive(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "\nState:\tZ" not in status.read_text()


def test_every_failed_rescore_holds_the_champion_with_a_one_line_reason(champion: Path) -> None:
    uri = "models:/sd-test/1"
    results = {mode: attempt(champion, "1", uri, {"RESCORE_MODE": mode}, timeout_s=5)
               for mode in ("crash", "killed", "silent", "hang")}
    assert results["crash"] == {"version": "1", "error": (
        f"re-scoring {uri} failed (exit 1): RuntimeError: the denoiser's weights do not match this family")}
    assert results["killed"]["error"] == (f"re-scoring {uri} failed: the evaluate command was killed by SIGKILL "
                                          "(out of memory?); the flow's log has its output")
    assert results["silent"]["error"] == (f"re-scoring {uri}: the evaluate command succeeded but wrote no "
                                          "report (evaluate.json)")
    assert results["hang"]["error"] == f"re-scoring {uri} stopped after 5 s (register.rescore_timeout_min)"
    grandchild = int((champion / "grandchild.pid").read_text())
    assert not _alive(grandchild), "the timed-out command's own children are stopped with it"
    # a version that is not there (deleted, or another model's): MLflow's own error, not a flow crash
    other = attempt(champion, "1", "models:/sd-test/7", {"RESCORE_MODE": "crash"}, timeout_s=5)
    assert other["error"].startswith("MlflowException: ") and len(other["error"]) <= 300
    # files missing from the stored version: refused against its manifest before anything runs
    client = mlflow.MlflowClient()
    stored = client.get_logged_model(client.get_model_version("sd-test", "1").source.split("/")[-1])
    shutil.rmtree(Path(urlparse(stored.artifact_location).path) / "artifacts" / "openvino")
    missing = attempt(champion, "1", uri, {"RESCORE_MODE": "crash"}, timeout_s=5)
    assert "openvino" in missing["error"] and "\n" not in missing["error"]
    for result in (*results.values(), other, missing):
        assert "\n" not in result["error"] and not _LOG_PREFIX.search(result["error"]), result

    # the candidate, better on paper, is registered; champion holds; the reason is on it in one line
    second = register(*_args(champion), champion_rescore=results["crash"])
    assert (second.version, second.champion_moved) == ("2", False)
    assert str(client.get_model_version_by_alias("sd-test", "champion").version) == "1"
    assert str(client.get_model_version_by_alias("sd-test", "candidate").version) == "2"
    mv = client.get_model_version("sd-test", "2")
    assert mv.tags["champion.rescore_error"] == results["crash"]["error"]
    decision = mv.tags["champion.decision"]
    assert decision.startswith("not promoted: champion v1 was scored under evaluation protocol old")
    assert f"re-scoring it failed: {results['crash']['error']}" in decision
    summary = mv.description.split("\n\n")[0]
    assert decision in summary and "\n" not in summary and not _LOG_PREFIX.search(summary)


def test_the_runs_a_stopped_or_failed_rescore_left_running_are_ended(champion: Path) -> None:
    """The evaluate command started its MLflow run (a child of the flow's run), then hung past the
    timeout, or died without ending it: its run is ended KILLED or FAILED with the reason; the flow's
    run and another run still RUNNING are left alone."""
    client = mlflow.MlflowClient()
    experiment = client.get_experiment_by_name("finetune") or client.get_experiment(
        client.create_experiment("finetune"))
    parent = client.create_run(experiment.experiment_id, tags={"pipeline": "finetune"}).info.run_id
    other = client.create_run(experiment.experiment_id, tags={"mlflow.parentRunId": parent}).info.run_id
    uri = "models:/sd-test/1"
    env = {PARENT_ENV: parent}
    hung = attempt(champion, "1", uri, {**env, "RESCORE_MODE": "run-hang"}, timeout_s=15)
    exited = attempt(champion, "1", uri, {**env, "RESCORE_MODE": "run-exit"}, timeout_s=60)
    assert hung["error"] == f"re-scoring {uri} stopped after 15 s (register.rescore_timeout_min)"
    assert exited["error"].startswith(f"re-scoring {uri} failed (exit 3): ")
    runs = client.search_runs([experiment.experiment_id], filter_string="tags.stage = 'evaluate'",
                              order_by=["attributes.start_time ASC"])
    assert [(r.info.status, r.data.tags["mlflow.parentRunId"]) for r in runs] == [
        ("KILLED", parent), ("FAILED", parent)], "the command's run was not started, or not ended"
    assert [r.data.tags["error"] for r in runs] == [hung["error"], exited["error"]]
    assert len({r.data.tags[RESCORE_TAG] for r in runs}) == 2, "one id per re-score"
    assert all(r.info.end_time for r in runs)
    assert [client.get_run(run).info.status for run in (parent, other)] == ["RUNNING", "RUNNING"]


def test_a_rescore_report_without_a_usable_score_holds_the_champion(champion: Path) -> None:
    """A report the evaluate command wrote, but with no finite primary score or no protocol: no score
    for the champion, and the candidate says why."""
    client = mlflow.MlflowClient()
    nan = {"version": "1", "report": {"metrics": {"dino": float("nan")}, "protocol": {"id": "new"}}}
    second = register(*_args(champion), champion_rescore=nan)
    assert not second.champion_moved
    mv = client.get_model_version("sd-test", second.version)
    assert mv.tags["champion.rescore_error"] == "the re-score's report has no finite dino (nan)"
    assert "rescore.new" not in client.get_model_version("sd-test", "1").tags


def test_a_champion_whose_lineage_cannot_be_fetched_has_no_score(champion: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The store failing while the champion's lineage document is fetched, or its run (the document's
    digest) unreadable: it has no score, so it holds, and the note says why in one line."""
    from tasks.register.registry import current_champion

    def broken(self, run_id, path, dst_path=None):
        raise OSError(5, "Input/output error\n  while reading lineage.json")

    client = mlflow.MlflowClient()
    run_id = client.get_model_version("sd-test", "1").run_id
    get_run, download = mlflow.MlflowClient.get_run, mlflow.MlflowClient.download_artifacts
    monkeypatch.setattr(mlflow.MlflowClient, "download_artifacts", broken)
    held = current_champion(client, "sd-test", "dino")
    assert held is not None and held.score is None
    assert held.note.endswith("cannot be fetched: OSError: [Errno 5] Input/output error while reading lineage.json")
    monkeypatch.setattr(mlflow.MlflowClient, "download_artifacts", download)

    def unreadable(self, wanted):  # the run holding its lineage digest cannot be read
        if wanted == run_id:
            raise MlflowException("run gone")
        return get_run(self, wanted)

    monkeypatch.setattr(mlflow.MlflowClient, "get_run", unreadable)
    held = current_champion(client, "sd-test", "dino")
    assert held is not None and held.score is None and "\n" not in held.note
    assert held.note.startswith(f"sd-test v1: its run {run_id} cannot be read (INTERNAL_ERROR)")


def test_the_reason_of_any_exception_is_one_short_line() -> None:
    from tasks.common.errors import UserError
    from tasks.register.oneline import reason

    assert reason(UserError("no openvino/ in v2")) == "no openvino/ in v2"
    assert reason(KeyError("metrics")) == "KeyError: 'metrics'"
    assert reason(TimeoutError()) == "TimeoutError"
    long = reason(RuntimeError("10:41:02 INFO x: a\n" + "b" * 1000))
    assert len(long) == 300 and long.startswith("RuntimeError: a b") and "\n" not in long


def test_a_champion_registered_without_a_manifest_is_not_rescored(project: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Unverified by default: a champion with no manifest (registered by other code) is refused before
    its files are used, the error naming the setting that allows it; the champion then holds."""
    from tasks.register import manifest

    monkeypatch.setattr(manifest, "record_logged", lambda *args, **kwargs: None)
    _report(project, "old", 0.2)
    assert register(*_args(project)).champion_moved
    monkeypatch.delenv(manifest.ALLOW_ENV, raising=False)
    refused = attempt(project, "1", "models:/sd-test/1", {"RESCORE_MODE": "crash"}, timeout_s=5)
    assert "registered without a manifest" in refused["error"] and "FINETUNE_ALLOW_UNVERIFIED=1" in refused["error"]
    assert "\n" not in refused["error"]
