"""Re-score the champion under the current evaluation protocol, in the same run.

Promotion compares scores only under one protocol (tasks/register/promotion.py). When the champion
was scored under another one (other encoders, prompts, precision...), the flow runs the evaluate
stage's own command (dvc.yaml's `evaluate` cmd, with `--model` pointing at the champion's
registered fine-tune, `--export` at its registered OpenVINO export, `--base` at its registered
base when it was registered as adapters + base, and the outputs in a temporary folder) before registering, so the
challenger and the champion are compared on the same yardstick. The evaluate run is logged as a
child of the flow's run like any stage; the scores are recorded on both versions by tasks/register.
A champion registered with run-time adapters (`export.adapters: runtime`) holds no export of its
own: its export is rebuilt from its adapter and its registered base export's version.

Which protocol the champion was scored under is read from its lineage document
(tasks/register/registry.py), not its `protocol` tag. The re-score is trusted because this flow
run computed it and hands the report to tasks/register in-process; the `rescore.<protocol>` tag
it leaves on the champion (and the new version's `champion.rescored`) are display only: nothing
reads them back, so a forged one changes no decision. A later registration under the same new
protocol re-scores the champion again rather than trust a tag.

A re-score that fails, for whatever reason (the champion's files missing or not matching its
manifest, a model the evaluate command cannot load, the command crashing or killed, no report,
running past `register.rescore_timeout_min`), never stops the flow: `attempt` returns the reason
in one short line (tasks/register/oneline.py; the command's whole output goes to the flow's log),
the candidate is still registered, `champion` holds, and the candidate's tag
`champion.rescore_error` and its description say why (tasks/register/registry.py, `rescored`).

Every MLflow run the command starts carries the tag `rescore.id` (one id per re-score, given through
MLflow's own MLFLOW_RUN_CONTEXT); a run it left RUNNING because it was stopped or failed is ended
through the flow's client (`close_runs`): KILLED when the command was stopped (timeout, signal),
FAILED when it exited with an error, its `error` tag saying why. A killed command cannot end its run
itself; otherwise it stayed RUNNING until the flow's run ended (and closed it as a stage killed for
memory), or for good when the re-score had no parent run.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from finetune_runtime import base_reference
from finetune_runtime.genai_serving import ADAPTER_ARTIFACT
from tasks.common.errors import UserError
from tasks.register.base_export import runtime_export_of
from tasks.register.naming import Lineage
from tasks.register.oneline import last_error, one_line, reason
from tasks.register.promotion import Champion, other_lineage

log = logging.getLogger(__name__)

#: The tag of every MLflow run a re-score's command starts: its re-score's id (`close_runs`).
RESCORE_TAG = "rescore.id"
#: MLflow's own variable: JSON tags added to every run a process starts with `mlflow.start_run`.
RUN_CONTEXT_ENV = "MLFLOW_RUN_CONTEXT"

#: Arguments of the evaluate command that name where it writes (replaced by a temporary folder).
_OUTPUT_ARGS = ("--out", "--report", "--metrics")


def needs_rescore(champion: Champion | None, report: Mapping[str, Any], lineage: Lineage | None = None) -> bool:
    """True when a champion exists and the protocol its lineage document records (None: unknown,
    or no document) differs from the current evaluation's, or its score cannot be read (without
    one it holds: tasks/register/promotion.py). Never for a champion of another family or task than
    the candidate's `lineage`: it is not ranked against (tasks/register/naming.py)."""
    if champion is None or other_lineage(champion, lineage):
        return False
    current = (report.get("protocol") or {}).get("id")
    return bool(current) and (champion.protocol != current or champion.score is None)


#: The registered model's artifacts that replace the evaluate command's inputs.
_INPUT_ARGS = {"--model": "finetuned", "--export": "openvino", "--base": "base"}


def evaluate_command(workdir: Path, artifacts: Mapping[str, Path], out: Path) -> list[str]:
    """dvc.yaml's evaluate command on the registered `artifacts` (finetuned, openvino, base when
    registered) and its outputs under `out`; an input with no registered artifact is kept."""
    stages = (yaml.safe_load((workdir / "dvc.yaml").read_text()) or {}).get("stages") or {}
    if "evaluate" not in stages:
        raise UserError(f"{workdir / 'dvc.yaml'} has no 'evaluate' stage to re-score with")
    argv = shlex.split(str(stages["evaluate"]["cmd"]))
    if argv[:1] == ["python"]:
        argv[0] = sys.executable
    if "openvino" not in artifacts and "--export" in argv:  # registered without an export (export.enabled)
        del argv[argv.index("--export"):argv.index("--export") + 2]
    for i, arg in enumerate(argv[:-1]):
        if _INPUT_ARGS.get(arg) in artifacts:
            argv[i + 1] = str(artifacts[_INPUT_ARGS[arg]])
        elif arg in _OUTPUT_ARGS:
            argv[i + 1] = str(out / Path(argv[i + 1]).name)
    return argv


def attempt(workdir: Path, version: str, model_uri: str, env: Mapping[str, str],
            timeout_s: float | None = None) -> dict[str, Any]:
    """Re-score version `version` (`model_uri`) and hand the result on: {"version", "report"}, or,
    whatever went wrong, {"version", "error"} with the reason in one short line. Never raises an
    Exception: a champion that cannot be re-scored holds, and the candidate is still registered."""
    try:
        return {"version": str(version), "report": rescore(workdir, model_uri, env, timeout_s)}
    except Exception as err:  # any failure holds the champion, with its reason
        why = reason(err)
        log.warning("could not re-score %s, so the champion holds: %s", model_uri, why,
                    exc_info=not isinstance(err, UserError))
        return {"version": str(version), "error": why}


def rescore(workdir: Path, model_uri: str, env: Mapping[str, str],
            timeout_s: float | None = None) -> dict[str, Any]:
    """Run the evaluate stage on the registered model `model_uri`; its report and seconds. The
    command is stopped (its whole process group) after `timeout_s` seconds (None: no limit)."""
    import time

    from flows.dvc_stage import stage_env
    from tasks.register.verified import download

    with tempfile.TemporaryDirectory(prefix="rescore-") as tmp:
        local = Path(download(model_uri, str(Path(tmp) / "m")))  # checked against its manifest
        artifacts = _inputs(local, model_uri, Path(tmp))
        out = Path(tmp) / "out"
        out.mkdir()
        cmd = evaluate_command(workdir, artifacts, out)
        if "--report" not in cmd[:-1]:
            raise UserError(f"{workdir / 'dvc.yaml'}: the evaluate command has no --report to read the scores from")
        start = time.monotonic()
        _run(cmd, workdir, tagged(stage_env(env), uuid.uuid4().hex), model_uri, timeout_s)
        report_path = Path(cmd[cmd.index("--report") + 1])
        if not report_path.is_file():
            raise UserError(f"re-scoring {model_uri}: the evaluate command succeeded but wrote no report "
                            f"({report_path.name})")
        try:
            report = json.loads(report_path.read_text())
        except ValueError as err:
            raise UserError(f"re-scoring {model_uri}: its report {report_path.name} is not JSON ({err})") from None
    if not isinstance(report, dict):
        raise UserError(f"re-scoring {model_uri}: its report is not a JSON object")
    report["seconds_total"] = round(time.monotonic() - start, 2)
    return report


def _inputs(local: Path, model_uri: str, tmp: Path) -> dict[str, Path]:
    """The evaluate command's inputs from the downloaded version `local` (_INPUT_ARGS' folders; a
    base registered by reference found on this machine; an export rebuilt from run-time adapters)."""
    artifacts = {name: local / "artifacts" / name for name in _INPUT_ARGS.values()
                 if (local / "artifacts" / name).is_dir()}
    if "finetuned" not in artifacts:
        raise UserError(f"{model_uri} has no fine-tuned model to re-score (artifacts/finetuned)")
    reference = local / "artifacts" / base_reference.ARTIFACT
    if reference.is_dir():  # a big base, registered by reference: its own folder, never the workspace's
        try:
            found = base_reference.local_folder(reference)
        except ValueError as err:
            raise UserError(f"re-scoring {model_uri}: {err}") from None
        if found is None:
            raise UserError(f"re-scoring {model_uri}: its base is registered by reference and not on this "
                            f"machine: set {base_reference.BASE_DIR_ENV} to a copy of it")
        artifacts["base"] = Path(found)
    adapter = local / "artifacts" / ADAPTER_ARTIFACT
    if adapter.is_dir() and "openvino" not in artifacts:  # run-time adapters: the export is rebuilt
        artifacts["openvino"], artifacts["base"] = runtime_export_of(adapter, tmp / "export")
    return artifacts


def tagged(env: Mapping[str, str], rescore_id: str) -> dict[str, str]:
    """`env` whose MLflow runs carry RESCORE_TAG=`rescore_id` (beside the MLFLOW_RUN_CONTEXT tags it had)."""
    context = json.loads(env.get(RUN_CONTEXT_ENV) or "{}")
    return {**env, RUN_CONTEXT_ENV: json.dumps({**context, RESCORE_TAG: rescore_id})}


def close_runs(env: Mapping[str, str], workdir: Path, status: str, why: str) -> list[str]:
    """End as `status` (KILLED, FAILED), with `why` as their `error` tag, the runs that the command run
    under `env` (made by `tagged`) started and left RUNNING; their ids. Never raises: a run that
    cannot be ended is logged, the re-score's own reason stays the one handed on."""
    import mlflow

    from tasks.common.tracking import tracking_uri

    rescore_id = json.loads(env[RUN_CONTEXT_ENV])[RESCORE_TAG]
    uri = env.get("MLFLOW_TRACKING_URI") or tracking_uri(workdir)  # where the command logged
    closed: list[str] = []
    try:
        client = mlflow.MlflowClient(uri)
        experiments = [e.experiment_id for e in client.search_experiments()]
        left = client.search_runs(experiments, filter_string=(
            f"tags.`{RESCORE_TAG}` = '{rescore_id}' and attributes.status = 'RUNNING'")) if experiments else []
        for run in left:
            client.set_tag(run.info.run_id, "error", one_line(why, 5000))
            client.set_terminated(run.info.run_id, status)
            closed.append(run.info.run_id)
    except Exception as err:  # the re-score failed already: say this, keep its reason
        log.warning("the re-score's MLflow runs left RUNNING at %s could not be ended (%s): %s", uri,
                    reason(err), ", ".join(closed) or "none ended")
        return closed
    if closed:
        log.warning("ended the re-score's MLflow run(s) %s as %s: %s", ", ".join(closed), status, why)
    return closed


def _run(cmd: list[str], workdir: Path, env: dict[str, str], model_uri: str, timeout_s: float | None) -> None:
    """Run the evaluate command in its own process group; its whole output in the flow's log when it
    fails, its error in one line for the tags. Past `timeout_s` the group is killed. The MLflow runs
    it left RUNNING when it fails are ended (`close_runs`)."""
    proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the command and whatever it started
        output, _ = proc.communicate()
        log.warning("re-scoring %s: the evaluate command's output before it was stopped:\n%s", model_uri,
                    (output or "")[-6000:])
        why = f"re-scoring {model_uri} stopped after {timeout_s:.0f} s (register.rescore_timeout_min)"
        close_runs(env, workdir, "KILLED", why)
        raise UserError(why) from None
    if proc.returncode != 0:
        log.warning("re-scoring %s: the evaluate command's output:\n%s", model_uri, (output or "")[-6000:])
        if proc.returncode < 0:  # what it printed last is not why: a signal stopped it
            why = (f"re-scoring {model_uri} failed: the evaluate command was killed by "
                   f"{signal.Signals(-proc.returncode).name} (out of memory?); the flow's log has its output")
            close_runs(env, workdir, "KILLED", why)
            raise UserError(why)
        why = f"re-scoring {model_uri} failed (exit {proc.returncode}): {last_error(output or '')}"
        close_runs(env, workdir, "FAILED", why)
        raise UserError(why)
