"""The Prefect flow `finetune`: run the DVC stages in dvc.yaml order, then register the model.

Small on purpose: DVC owns the DAG and decides what reruns (an unchanged stage is skipped and
shown as `Skipped`), the stages own the work and log their own MLflow child runs, and this flow
owns order, retries and registration. One MLflow parent run records the whole pipeline run:
overrides, the full params used, each stage's verdict (ran/skipped), the model and dvc.lock.

Run it: `python -m flows.finetune [--set train.max_train_steps=5 ...] [--no-register]`, or via
the deployment: `prefect deployment run finetune/main [--param overrides='{"train.seed": 1}']`.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml
from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.states import Completed, State

from flows import dvc_stage, experiment, report
from flows import remote as dvc_remote
from flows.changes import detect_changes
from flows.data_check import check_tracked_folders
from flows.params import check_params, stage_output, validate_overrides
from flows.parent_run import ParentRun, parent_run
from flows.sections import stage_names
from flows.workspace import workspace_lock
from tasks.common.config import load_config
from tasks.common.errors import UserError, main_guard
from tasks.common.tracking import (
    PARENT_ENV,
    experiment_name,
    server_answers,
    tracking_uri,
    wait_for_server,
)
from tasks.register.config import RegisterConfig

REPO = Path(__file__).resolve().parents[1]

#: What registration reads, as the stage and argument dvc.yaml gives each path to (the paths are
#: written there only; flows.params.stage_output reads them).
OUTPUTS = {"base": ("base", "--out"), "finetuned": ("train", "--out"), "openvino": ("export", "--out"),
           "evaluation": ("evaluate", "--report"), "training": ("train", "--report"),
           "grids": ("evaluate", "--out"), "loss": ("train", "--plot")}
#: Of OUTPUTS, what a pipeline of one's own may leave out (no base stage; a train stage without a report;
#: no plots for the version's run to show).
OPTIONAL_OUTPUTS = ("base", "training", "grids", "loss")

#: A stage killed by SIGKILL/SIGTERM (OOM killer, container limit, node drain) is retried: the rerun
#: resumes from its checkpoint (train) or redoes a cheap stage. A config or data error (a stage's
#: UserError, exit 2) fails the same way every time, so `_retry_when_killed` refuses to retry it.
#: A briefly unreachable MLflow server is waited for inside the stage (tasks/common/tracking.py).
STAGE_RETRIES = 2
STAGE_RETRY_DELAY_S = 10


def _output(root: Path, name: str) -> Path | None:
    """Where the pipeline in `root` writes `name` of OUTPUTS (None: its dvc.yaml has no such stage)."""
    rel = stage_output(root / "dvc.yaml", *OUTPUTS[name])
    return None if rel is None else root / rel


def _evaluation(workdir: Path) -> dict[str, Any] | None:
    """The evaluate stage's report in `workdir`, or None when there is none."""
    path = _output(workdir, "evaluation")
    return json.loads(path.read_text()) if path is not None and path.is_file() else None


def _retry_when_killed(task: Any, task_run: Any, state: State) -> bool:
    """Prefect's retry_condition_fn: retry only a stage that a signal killed."""
    try:
        state.result()
    except dvc_stage.StageFailed as err:
        if err.killed:
            get_run_logger().warning(
                "stage '%s' was killed by signal %s: retrying", err.stage, err.signal)
        return err.killed
    except Exception:
        return False
    return False


@task(
    name="dvc-repro",
    task_run_name="{stage}",
    retries=STAGE_RETRIES,
    retry_delay_seconds=STAGE_RETRY_DELAY_S,
    retry_condition_fn=_retry_when_killed,
    cache_policy=NO_CACHE,  # DVC is the cache: it skips the stage when nothing changed
)
def repro_stage(stage: str, root: str, parent_run_id: str, tracking: str | None = None,
                pull: bool = False) -> State:
    """`dvc repro --single-item [--pull] <stage>` in `root`; Completed when it ran, `Skipped` when
    DVC skipped it. The stage logs to `tracking` (default: `root`'s tracking store)."""
    logger = get_run_logger()
    env = {
        PARENT_ENV: parent_run_id,
        "MLFLOW_TRACKING_URI": tracking or tracking_uri(Path(root)),
        "MLFLOW_EXPERIMENT_NAME": experiment_name(),
    }
    result = dvc_stage.repro(stage, Path(root), env, log=logger.info, pull=pull)
    data = result.as_dict()
    if result.status == "ran":
        return Completed(message=f"stage '{stage}' ran ({result.seconds} s)", data=data)
    why = {"skipped": "unchanged", "restored": "restored from DVC's run-cache",
           "pulled": "unchanged, outputs pulled from the DVC remote"}[result.status]
    logger.info("stage '%s' skipped by DVC: %s", stage, why)
    return Completed(name="Skipped", message=f"stage '{stage}' skipped by DVC: {why}", data=data)


@task(name="register", task_run_name="register", cache_policy=NO_CACHE)
def register_model(root: str, parent_run_id: str, flow_run_id: str | None,
                   tags: dict[str, Any] | None = None,
                   champion_rescore: dict[str, Any] | None = None) -> dict[str, Any]:
    """Register the pyfunc (pipeline + OpenVINO export) in the parent run; move the aliases."""
    from mlflow.exceptions import MlflowException

    from tasks.register.core import register

    base = Path(root)
    paths = {name: _output(base, name) for name in OUTPUTS}
    if missing := [name for name, path in paths.items() if path is None and name not in OPTIONAL_OUTPUTS]:
        raise UserError(f"nothing to register: {base / 'dvc.yaml'} gives no path for "
                        + ", ".join(f"{name} ({' '.join(OUTPUTS[name])})" for name in missing))
    extra = dict(tags or {})  # the version's run is the parent run: no tag needed for it
    if flow_run_id:
        extra["prefect_flow_run_id"] = flow_run_id
    try:
        result = register(
            paths["finetuned"], paths["openvino"], paths["evaluation"], lock=base / "dvc.lock",
            params=base / "params.yaml", run_id=parent_run_id, extra_tags=extra,
            base=paths["base"], champion_rescore=champion_rescore, train_report=paths["training"],
            grids=paths["grids"], loss_table=paths["loss"],
        )
    except MlflowException as err:
        uri = tracking_uri(base)
        if not uri.startswith(("http://", "https://")) or server_answers(uri):
            raise
        raise UserError(
            f"registration stopped: the MLflow tracking server {uri} stopped answering "
            f"({str(err)[:300]}). Nothing was registered (a version is created in one request, "
            "after its files and lineage are stored). Restart the server (infra/README.md) and "
            "run the flow again: the finished stages are skipped"
        ) from None
    get_run_logger().info(
        "registered %s version %s, aliases %s",
        result.name, result.version, ", ".join(result.aliases),
    )
    return {"name": result.name, "version": result.version, "aliases": list(result.aliases),
            "decision": result.decision}


def _flow_run_id() -> str | None:
    from prefect.runtime import flow_run

    return flow_run.id


@flow(name="finetune")
def finetune(
    overrides: dict[str, Any] | None = None,
    register_model: bool = True,
    only_if_changed: bool = False,
) -> dict[str, Any]:
    """Fine-tune: every DVC stage in dvc.yaml order (DVC skips unchanged ones), then register.

    overrides: dotted keys and values, e.g. {"train.max_train_steps": 5}: any key of
    docs/parameters.md, written in params.yaml or not; validated against the stage configs
    before anything runs, then run as a DVC experiment in a workspace of its own
    (flows/experiment.py): the tracked params.yaml and the outputs stay as they were.
    register_model: register the model in MLflow (alias `candidate`; `champion` when the gate
    passed and it beats the current champion on register.primary_metric). Not `register`: Prefect
    builds the flow's parameters into a pydantic model, where that name shadows a class attribute.
    only_if_changed: first compare data, code and params with the last registered version
    (flows/changes.py); when nothing changed, end at once as "up to date" and register nothing.
    """
    logger = get_run_logger()
    root = REPO
    flow_run_id = _flow_run_id()
    with workspace_lock(root, owner=f"flow run {flow_run_id}" if flow_run_id else ""):
        applied = check_overrides(root, overrides)  # bad ones fail here, first
        wait_for_server(tracking_uri(root))  # bounded; a clear error before anything runs
        stages = stage_names(root / "dvc.yaml")
        summary = _run(root, stages, applied, register_model, only_if_changed, flow_run_id)
    _publish(summary, root)
    logger.info("pipeline done: %s", json.dumps(summary))
    if hint := dvc_stage.lock_hint(root):
        logger.info(hint)
    return summary


def check_overrides(root: Path, overrides: dict[str, Any] | None) -> dict[str, Any]:
    """`overrides` as they will be applied, once each key is known (in params.yaml or defined by
    its stage's typed config: docs/parameters.md), every section validates as its config, no
    combination a later stage refuses is set (flows/params.py `check_params`); and, when there are
    any, the git repository they run in as a DVC experiment.
    A UserError naming the key otherwise; and one naming each FIFO, socket or device in a folder
    tracked with `dvc add`, which DVC would block on (flows/data_check.py). Reads files only (and
    asks git): the CLI calls it before Prefect starts a server, the flow again for runs started by
    a deployment."""
    applied = validate_overrides(root / "params.yaml", overrides)
    check_params(root / "params.yaml", applied)  # every section, and what a later stage would refuse
    check_tracked_folders(root)  # no FIFO where DVC hashes a folder itself (flows/data_check.py)
    if applied:
        experiment.require_git(root)
    return applied


def _run(root: Path, stages: list[str], applied: dict[str, Any], register: bool,
         only_if_changed: bool, flow_run_id: str | None) -> dict[str, Any]:
    """In the workspace; or, with overrides, as a DVC experiment in a workspace of its own."""
    if not applied:
        return _run_if_changed(root, root, stages, applied, register, only_if_changed,
                               flow_run_id)
    name = experiment.experiment_name(flow_run_id)
    get_run_logger().info("overrides %s: running as DVC experiment '%s'",
                          json.dumps(applied, sort_keys=True), name)
    with experiment.experiment_workspace(root, name, applied) as workdir:
        return _run_if_changed(root, workdir, stages, applied, register, only_if_changed,
                               flow_run_id, experiment_name=name)


def _run_if_changed(root: Path, workdir: Path, stages: list[str], applied: dict[str, Any],
                    register: bool, only_if_changed: bool, flow_run_id: str | None,
                    experiment_name: str | None = None) -> dict[str, Any]:
    """`only_if_changed`: compare `workdir` with the last registered version first. With a
    default DVC remote, the inputs are checked and pulled first (flows/remote.py)."""
    remote = dvc_remote.prepare(workdir, log=get_run_logger().info)
    changes = None
    if only_if_changed:
        model_name = planned_name(workdir)
        changes = detect_changes(workdir, model_name, tracking_uri(root),
                                 include_experiments=experiment_name is not None,
                                 allow_missing=remote is not None)
        get_run_logger().info("only_if_changed: %s", changes.summary())
        if not changes.changed:
            return {"up_to_date": True, "changes": changes.summary(), "stages": [],
                    "registered": None, "mlflow_run_id": None}
    summary = _run_pipeline(root, workdir, stages, applied, register, flow_run_id,
                            experiment_name, remote)
    if changes is not None:
        summary["changes"] = changes.summary()
    return summary


def _run_pipeline(root: Path, workdir: Path, stages: list[str], applied: dict[str, Any],
                  register: bool, flow_run_id: str | None,
                  experiment_name: str | None = None,
                  remote: dvc_remote.Remote | None = None) -> dict[str, Any]:
    """The stages in order in `workdir` under one MLflow parent run (recorded in `root`'s
    tracking store), then, for an experiment, `dvc exp save`, then `dvc push` to the default
    remote (a failed push registers nothing), then the registration."""
    logger = get_run_logger()
    with parent_run(root, flow_run_id) as parent:
        logger.info("MLflow parent run %s in %s", parent.run_id, tracking_uri(root))
        parent.log_dict(applied, "overrides.json")
        parent.set_tags({"overrides": json.dumps(applied, sort_keys=True)})
        results = _stages(workdir, stages, parent, tracking_uri(root), pull=remote is not None)
        extra: dict[str, Any] = {}
        if experiment_name:
            saved = experiment.save_experiment(workdir, experiment_name)
            extra = {"dvc.experiment": saved["name"], "dvc.experiment.rev": saved["rev"],
                     "overrides": json.dumps(applied, sort_keys=True)}
        if remote is not None:
            dvc_remote.push(workdir, remote, log=logger.info)
            extra[dvc_remote.REMOTE_TAG] = remote.describe()
        parent.set_tags(extra)
        rescored = _rescore_champion(root, workdir, parent) if register else None
        registered = (register_model(str(workdir), parent.run_id, flow_run_id, extra, rescored)
                      if register else None)
        parent.log_artifact(workdir / "dvc.lock")
        experiment_id = parent.client.get_run(parent.run_id).info.experiment_id
    summary = {"mlflow_run_id": parent.run_id, "mlflow_experiment_id": experiment_id,
               "stages": results, "registered": registered}
    if experiment_name:
        summary["dvc_experiment"] = extra["dvc.experiment"]
    if remote is not None:
        summary["dvc_remote"] = remote.describe()
    evaluation = _evaluation(workdir)  # read now: an experiment's workspace goes away
    if evaluation is not None:
        summary["evaluation"] = evaluation
    return summary


def _rescore_champion(root: Path, workdir: Path, parent: ParentRun) -> dict[str, Any] | None:
    """When the champion was scored under another evaluation protocol (or its score cannot be
    read), score it again under the current one (flows/rescore.py), so promotion compares like
    with like; a re-score that fails, however, is handed on with its reason in one line: the
    candidate is still registered and the champion holds."""
    from mlflow.exceptions import MlflowException

    from flows import rescore
    from tasks.register.registry import current_champion

    logger = get_run_logger()
    cfg = load_config("register", RegisterConfig, workdir / "params.yaml")
    report = _evaluation(workdir)
    if report is None:
        return None
    lineage, name = _lineage(workdir, cfg)
    try:  # its protocol as its lineage document records it, not as its tag says
        champion = current_champion(parent.client, name, cfg.primary_metric)
    except MlflowException:
        return None
    if champion is None or not rescore.needs_rescore(champion, report, lineage):
        return None
    logger.info("champion v%s was scored under protocol %s; re-scoring it under %s",
                champion.version, champion.protocol or "unknown", report["protocol"]["id"])
    env = {PARENT_ENV: parent.run_id, "MLFLOW_TRACKING_URI": tracking_uri(root),
           "MLFLOW_EXPERIMENT_NAME": experiment_name()}
    timeout = cfg.rescore_timeout_min * 60 if cfg.rescore_timeout_min is not None else None
    result = rescore.attempt(workdir, champion.version, f"models:/{name}/{champion.version}", env, timeout)
    if "error" in result:  # promotion fails closed: the champion holds
        logger.warning("could not re-score the champion v%s, so it holds: %s", champion.version, result["error"])
        parent.set_tags({"champion.rescore_error": result["error"]})
        return result
    parent.set_tags({"champion.rescored_seconds": result["report"]["seconds_total"]})
    logger.info("champion v%s re-scored in %s s", champion.version, result["report"]["seconds_total"])
    return result


def planned_name(workdir: Path) -> str | None:
    """The registered model a run of `workdir` goes to, before its stages (tasks/register/naming.py)."""
    from tasks.register.naming import planned

    return planned(workdir / "params.yaml", _output(workdir, "training"), _output(workdir, "base"))


def _lineage(workdir: Path, cfg: RegisterConfig) -> tuple[Any, str]:
    """What the stages in `workdir` trained (family, task, method) and the name it registers under."""
    from tasks.register.core import resolve
    from tasks.register.lineage import read_lock
    from tasks.register.training import read_train_report

    report = _output(workdir, "training")
    trained = read_train_report(report) if report is not None and report.is_file() else None
    finetuned = _output(workdir, "finetuned")
    return resolve(cfg, read_lock(workdir / "dvc.lock", required=()), trained, finetuned or workdir)


def _stages(workdir: Path, stages: list[str], parent: ParentRun,
            tracking: str, pull: bool = False) -> list[dict[str, Any]]:
    """Log the params used, then `dvc repro` (`--pull`) each stage in order in `workdir`."""
    parent.log_artifact(workdir / "params.yaml")
    parent.log_params(yaml.safe_load((workdir / "params.yaml").read_text()) or {})
    results = []
    for stage in stages:
        state = repro_stage(stage, str(workdir), parent.run_id, tracking, pull)
        result = state.result()
        results.append(result)
        parent.set_tags({f"stage.{stage}": result["status"]})
    skipped = [r["stage"] for r in results if r["status"] != "ran"]
    parent.set_tags({"stages.skipped": ",".join(skipped) or "none"})
    return results


def _publish(summary: dict[str, Any], root: Path) -> None:
    """The flow run's markdown artifact (metrics, gate, model version, MLflow link)."""
    from prefect.artifacts import create_markdown_artifact

    create_markdown_artifact(
        markdown=report.markdown(summary, tracking_uri(root)),
        key=report.ARTIFACT_KEY,
        description="finetune: stages, metrics, gate, registered model",
    )


def _parse_set(items: list[str]) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise UserError(
                f"--set {item!r}: expected KEY=VALUE, e.g. --set train.max_train_steps=5"
            )
        overrides[key.strip()] = yaml.safe_load(value)  # YAML typing: 5 -> int, true -> bool
    return overrides


@main_guard
def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m flows.finetune", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a parameter (repeatable; any key of docs/parameters.md, "
                             "the value read as YAML): train.max_train_steps=5")
    parser.add_argument("--no-register", action="store_true", help="run the stages only")
    parser.add_argument("--only-if-changed", action="store_true",
                        help="do nothing when data, code and params match the last registered model")
    args = parser.parse_args()
    overrides = _parse_set(args.set) or None
    check_overrides(REPO, overrides)  # a bad key or value fails in a second, before any server
    try:
        finetune(overrides=overrides, register_model=not args.no_register,
                 only_if_changed=args.only_if_changed)
    except dvc_stage.StageFailed as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
