"""The flow on a toy DVC project (two stages that log MLflow runs through tasks.common.tracking),
against a real temporary Prefect server: order, skip reporting, parent/child runs, overrides,
failures. The real pipeline under the real deployment is in tests/e2e/test_prefect_deployment.py."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
import yaml

import flows.finetune as finetune_module
from flows.dvc_stage import StageFailed
from tasks.common.errors import UserError
from tests.conftest import REPO
from tests.flows.conftest import git as _git


def _set_params(root: Path, section: str, **values) -> None:
    """Edit the toy's params.yaml the way a person would (not an override)."""
    params = yaml.safe_load((root / "params.yaml").read_text())
    params[section].update(values)
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def _runs(parent_id: str) -> list:
    return mlflow.search_runs(search_all_experiments=True, output_format="list",
                              filter_string=f"tags.mlflow.parentRunId = '{parent_id}'")


def test_runs_stages_in_order_then_skips_them(prefect_server, toy: Path) -> None:
    _set_params(toy, "first", value=5)
    first = finetune_module.finetune(register_model=False)
    assert [(s["stage"], s["status"]) for s in first["stages"]] == [("second", "ran"), ("first", "ran")]

    client = mlflow.MlflowClient()
    parent = client.get_run(first["mlflow_run_id"])
    assert parent.info.status == "FINISHED" and parent.info.run_name.startswith("finetune-")
    assert parent.data.tags["stage.second"] == "ran" and parent.data.tags["stages.skipped"] == "none"
    assert parent.data.params["first.value"] == "5"  # the params used, after overrides
    assert {a.path for a in client.list_artifacts(parent.info.run_id)} >= {
        "params.yaml", "dvc.lock", "overrides.json"}
    assert parent.data.tags["overrides"] == "{}" and "dvc.experiment" not in parent.data.tags
    children = _runs(parent.info.run_id)
    assert sorted(r.data.tags["stage"] for r in children) == ["first", "second"]
    assert {r.data.metrics["value"] for r in children} == {1.0, 5.0}

    state = finetune_module.finetune(register_model=False, return_state=True)
    again = state.result()
    assert [s["status"] for s in again["stages"]] == ["skipped", "skipped"]
    parent2 = client.get_run(again["mlflow_run_id"])
    assert parent2.data.tags["stage.first"] == "skipped"
    assert parent2.data.tags["stages.skipped"] == "second,first"
    assert _runs(parent2.info.run_id) == []  # nothing ran, so no child runs

    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as prefect:
        only_this_run = FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))
        tasks = prefect.read_task_runs(flow_run_filter=only_this_run)
    by_name = {t.name: t.state for t in tasks}
    assert by_name["second"].name == "Skipped" and by_name["second"].is_completed()
    assert "skipped by DVC: unchanged" in by_name["second"].message


def test_bad_overrides_fail_before_anything_runs(prefect_server, toy: Path) -> None:
    (toy / "params.yaml").chmod(0o664)
    before, mode = (toy / "params.yaml").read_bytes(), (toy / "params.yaml").stat().st_mode
    with pytest.raises(UserError, match="override 'first.valu'"):
        finetune_module.finetune(overrides={"first.valu": 3}, register_model=False)
    # A value the stage's typed config refuses (register is read by RegisterConfig).
    with pytest.raises(UserError, match=r"register.model_name: String should match") as err:
        finetune_module.finetune(overrides={"first.value": 4, "register.model_name": "no spaces"},
                                 register_model=False)
    assert "with overrides register.model_name='no spaces'" in str(err.value)
    assert (toy / "params.yaml").read_bytes() == before
    assert (toy / "params.yaml").stat().st_mode == mode
    assert not (toy / "second.out").exists()
    assert mlflow.search_runs(search_all_experiments=True, output_format="list") == []


def _experiments(root: Path) -> dict[str, dict]:
    """`dvc exp show --json`: experiment name -> its params.yaml params."""
    out = subprocess.run([sys.executable, "-m", "dvc", "exp", "show", "--json"], cwd=root,
                         check=True, capture_output=True, text=True).stdout
    found = {}
    for baseline in json.loads(out):
        for exp in baseline.get("experiments") or []:
            for rev in exp.get("revs") or []:
                params = rev["data"]["params"]["params.yaml"]["data"]
                found[rev["name"]] = params
    return found


def _snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    """Content and mode of every file git does not track, and of params.yaml."""
    files = [root / "params.yaml"] + [
        p for p in root.rglob("*")
        if p.is_file() and ".git" not in p.parts and ".dvc" not in p.parts]
    return {str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mode) for p in files}


def test_overrides_run_as_a_dvc_experiment_and_leave_the_workspace_alone(
        prefect_server, toy: Path) -> None:
    (toy / "params.yaml").chmod(0o664)
    plain = finetune_module.finetune(register_model=False)  # the workspace has outputs and dvc.lock
    assert [s["status"] for s in plain["stages"]] == ["ran", "ran"]
    before, status = _snapshot(toy), _git(toy, "status", "--porcelain")
    assert "dvc.lock" in before and "first.out" in before

    result = finetune_module.finetune(overrides={"first.value": 5}, register_model=False)
    # Carried over from the workspace, 'second' is unchanged: only 'first' reruns.
    assert [(s["stage"], s["status"]) for s in result["stages"]] == [("second", "skipped"),
                                                                      ("first", "ran")]
    name = result["dvc_experiment"]
    # The workspace is as it was: every file, dvc.lock and params.yaml included, content and mode.
    assert _snapshot(toy) == before
    assert _git(toy, "status", "--porcelain") == status
    assert _git(toy, "worktree", "list").count("\n") == 1  # the experiment's worktree is gone
    assert subprocess.run([sys.executable, "-m", "dvc", "status", "--json"], cwd=toy,
                          capture_output=True, text=True, check=True).stdout.strip() == "{}"
    # DVC lists the experiment with the overridden value; the run records it.
    assert _experiments(toy)[name]["first"]["value"] == 5
    parent = mlflow.MlflowClient().get_run(result["mlflow_run_id"])
    assert parent.data.tags["dvc.experiment"] == name
    assert json.loads(parent.data.tags["overrides"]) == {"first.value": 5}
    assert parent.data.params["first.value"] == "5"
    assert {r.data.metrics["value"] for r in _runs(parent.info.run_id)} == {5.0}

    # The next plain run uses the tracked params.yaml: nothing to do.
    again = finetune_module.finetune(register_model=False)
    assert [s["status"] for s in again["stages"]] == ["skipped", "skipped"]
    assert (toy / "first.out").read_text() == "2"


def test_a_failed_experiment_leaves_no_trace(prefect_server, toy: Path) -> None:
    before = (toy / "params.yaml").read_bytes()
    with pytest.raises(StageFailed, match="stage 'second' failed"):
        finetune_module.finetune(overrides={"second.fail": True}, register_model=False)
    assert (toy / "params.yaml").read_bytes() == before
    assert _experiments(toy) == {}
    assert _git(toy, "status", "--porcelain") == ""
    assert _git(toy, "worktree", "list").count("\n") == 1


def test_failing_stage_fails_the_flow_and_the_parent_run(prefect_server, toy: Path) -> None:
    _set_params(toy, "second", fail=True)
    with pytest.raises(StageFailed, match="stage 'second' failed") as err:
        finetune_module.finetune(register_model=False)
    assert "error: params.yaml: second.fail is set" in str(err.value)
    assert (toy / "second.attempts").read_text() == "x"  # a config error is not retried
    (parent,) = mlflow.search_runs(search_all_experiments=True, output_format="list",
                                   filter_string="tags.pipeline = 'finetune'")
    assert parent.info.status == "FAILED"
    assert "stage 'second' failed" in parent.data.tags["error"]
    # one line: the stage's error, without its log lines (flows/parent_run.py error_line)
    tag = parent.data.tags["error"]
    assert tag.endswith("params.yaml: second.fail is set") and "\n" not in tag, tag
    assert not (toy / "first.out").exists()  # later stages did not run


def _artifact(flow_run_id) -> str:
    """The markdown of the flow run's `finetune-summary` artifact, read back from the server."""
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as prefect:
        (art,) = prefect.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    assert art.key == "finetune-summary" and art.type == "markdown"
    return art.data


def test_only_if_changed_and_the_run_summary_artifact(prefect_server, toy: Path) -> None:
    from flows.changes import lineage_of_workspace
    from tasks.register.lineage import fingerprint

    state = finetune_module.finetune(register_model=False, return_state=True)
    first = state.result()
    page = _artifact(state.state_details.flow_run_id)
    assert f"MLflow run: [{first['mlflow_run_id']}](http://127.0.0.1:5000/#/experiments/" in page
    assert "| second | ran |" in page and "Not registered" in page

    # What tasks/register would leave: a version whose lineage is this workspace's dvc.lock
    # (lineage.json in its run, which the comparison reads; the tag is for display).
    client = mlflow.MlflowClient()
    client.create_registered_model("toy")
    built_from = lineage_of_workspace(toy)
    run = client.create_run(client.get_experiment_by_name("Default").experiment_id).info.run_id
    version = client.create_model_version("toy", source=str(toy), run_id=run, tags={
        "lineage.fingerprint": fingerprint(built_from)}).version
    client.log_dict(run, {"inputs": built_from, "model": {"name": "toy", "version": version,
                                                          "run_id": run}}, "lineage.json")
    runs_before = len(mlflow.search_runs(search_all_experiments=True, output_format="list"))

    state = finetune_module.finetune(only_if_changed=True, return_state=True)
    up_to_date = state.result()
    assert up_to_date["up_to_date"] is True and up_to_date["registered"] is None
    assert up_to_date["changes"] == "up to date: nothing changed since toy v1"
    assert len(mlflow.search_runs(search_all_experiments=True, output_format="list")) == runs_before
    assert (toy / "second.attempts").read_text() == "x"  # no stage command ran
    assert "**Up to date**: up to date: nothing changed since toy v1" in _artifact(
        state.state_details.flow_run_id)

    changed = finetune_module.finetune(overrides={"first.value": 7}, register_model=False,
                                       only_if_changed=True)
    assert [s["status"] for s in changed["stages"]] == ["skipped", "ran"]
    assert changed["changes"].startswith("changed: stage 'first': changed deps: params.yaml")


def test_a_killed_stage_is_retried_and_completes(prefect_server, toy: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    fast = finetune_module.repro_stage.with_options(retry_delay_seconds=0)
    monkeypatch.setattr(finetune_module, "repro_stage", fast)
    _set_params(toy, "second", kill_once=True)
    result = finetune_module.finetune(register_model=False)
    assert [s["status"] for s in result["stages"]] == ["ran", "ran"]
    assert (toy / "second.attempts").read_text() == "xx"  # killed once (SIGKILL), then completed
    assert (toy / "second.out").read_text() == "1"


def test_a_second_run_in_the_same_workspace_is_refused(prefect_server, toy: Path) -> None:
    """A real second process holds the workspace; the flow refuses before touching anything."""
    from flows.workspace import WorkspaceBusy, workspace_lock

    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; "
         "from flows.workspace import workspace_lock\n"
         f"with workspace_lock(Path({str(toy)!r}), owner='flow run other'):\n"
         "    print('locked', flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = (toy / "params.yaml").read_text()
        with pytest.raises(WorkspaceBusy) as err:
            finetune_module.finetune(overrides={"first.value": 9}, register_model=False)
        assert f"another pipeline run is already running in {toy} (pid {holder.pid}" in str(err.value)
        assert "flow run other" in str(err.value) and "separate clone" in str(err.value)
        assert (toy / "params.yaml").read_text() == before and not (toy / "second.out").exists()
    finally:
        holder.kill()  # killed, not released: the OS drops the lock with the process
        holder.wait()
    with workspace_lock(toy):
        pass
