"""The flow run's Prefect artifact: one markdown page saying what the run did and where to look.

Built here from plain data (pure, testable); flows/finetune.py publishes it with Prefect's
`create_markdown_artifact` under the key `finetune-summary`, so the UI's Artifacts page keeps the
history of every run under one key.
"""
from __future__ import annotations

import os
from typing import Any

ARTIFACT_KEY = "finetune-summary"


def mlflow_ui_base(tracking_uri: str) -> str:
    """Where the MLflow UI is: the tracking server itself, or `make mlflow-ui` for a local store.

    `MLFLOW_UI_URL` overrides both (e.g. a team server behind a proxy).
    """
    if os.environ.get("MLFLOW_UI_URL"):
        return os.environ["MLFLOW_UI_URL"].rstrip("/")
    if tracking_uri.startswith(("http://", "https://")):
        return tracking_uri.rstrip("/")
    return f"http://127.0.0.1:{os.environ.get('MLFLOW_PORT', '5000')}"


def run_link(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    return f"{mlflow_ui_base(tracking_uri)}/#/experiments/{experiment_id}/runs/{run_id}"


def model_link(tracking_uri: str, name: str, version: str) -> str:
    return f"{mlflow_ui_base(tracking_uri)}/#/models/{name}/versions/{version}"


def _fmt(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def markdown(summary: dict[str, Any], tracking_uri: str) -> str:
    """The page for one flow run. `summary` is what the flow returns, plus `evaluation`."""
    if summary.get("up_to_date"):
        return "\n".join(["# finetune", "", f"**Up to date**: {summary.get('changes', '')}. Nothing ran, "
                          "nothing was registered (`only_if_changed`)."]) + "\n"
    evaluation = summary.get("evaluation") or {}
    lines = ["# finetune", *_why(summary, tracking_uri), *_stages(summary.get("stages") or []),
             *_metrics(evaluation.get("metrics") or {}), *_fidelity(evaluation.get("export_fidelity") or {}),
             *_protocol(evaluation.get("protocol") or {}), *_gate(evaluation.get("gate")),
             *_model(summary.get("registered"), tracking_uri)]
    return "\n".join(lines) + "\n"


def _why(summary: dict[str, Any], tracking_uri: str) -> list[str]:
    """The MLflow run, why the flow ran, and the DVC experiment its overrides ran as."""
    lines = []
    run_id = summary.get("mlflow_run_id")
    if run_id:
        link = run_link(tracking_uri, summary.get("mlflow_experiment_id", "0"), run_id)
        lines += ["", f"MLflow run: [{run_id}]({link})"]
    if summary.get("changes"):
        lines += ["", f"Why it ran: {summary['changes']}"]
    if summary.get("dvc_experiment"):
        lines += ["", f"Overrides ran as DVC experiment `{summary['dvc_experiment']}` "
                  "(`dvc exp show`; `dvc exp apply` to bring it into the workspace); "
                  "params.yaml was left as it was."]
    return lines


def _stages(stages: list[dict[str, Any]]) -> list[str]:
    if not stages:
        return []
    return ["", "## Stages", "", "| stage | status | seconds |", "|---|---|---|",
            *(f"| {s['stage']} | {s['status']} | {s['seconds']} |" for s in stages)]


def _metrics(metrics: dict[str, Any]) -> list[str]:
    if not metrics:
        return []
    return ["", "## Metrics", "", "| metric | value |", "|---|---|",
            *(f"| {k} | {_fmt(v)} |" for k, v in sorted(metrics.items()))]


def _fidelity(fidelity: dict[str, Any]) -> list[str]:
    """Apart from the metrics (fine-tune and base both in PyTorch fp32)."""
    if not fidelity:
        return []
    figures = ("psnr_mean", "psnr_min", "delta_clip_t", "delta_clip_i", "delta_dino")
    return ["", f"## Export fidelity ({fidelity.get('backend')} vs the PyTorch fine-tune)",
            "", "| figure | value |", "|---|---|",
            *(f"| {k} | {_fmt(fidelity[k])} |" for k in figures if k in fidelity)]


def _protocol(protocol: dict[str, Any]) -> list[str]:
    if not protocol:
        return []
    calibrated = "" if protocol.get("calibrated", True) else f": **{protocol.get('uncalibrated_reason')}**"
    return ["", f"Evaluation protocol `{protocol.get('id')}`{calibrated}"]


def _gate(gate: dict[str, Any] | None) -> list[str]:
    if gate is None:
        return []
    checks = ", ".join(f"{k}: {'ok' if v else 'FAILED'}" for k, v in (gate.get("checks") or {}).items())
    verdict = "passed" if gate.get("passed") else "**did not pass**"
    return ["", f"## Gate: {verdict}" + (f" ({checks})" if checks else "")]


def _model(reg: dict[str, Any] | None, tracking_uri: str) -> list[str]:
    if not reg:
        return ["", "## Model", "", "Not registered (`register_model=False`)."]
    link = model_link(tracking_uri, reg["name"], reg["version"])
    return ["", "## Model", "", f"[{reg['name']} version {reg['version']}]({link}), aliases: "
            + ", ".join(f"`{a}`" for a in reg["aliases"]),
            "", f"Champion: {reg.get('decision', '')}",
            "", f"Load it: `mlflow.pyfunc.load_model('models:/{reg['name']}/{reg['version']}')`"]
