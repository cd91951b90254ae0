"""Lineage of a model version, read from what DVC and the evaluate stage wrote (pure, no MLflow).

- dvc.lock is DVC's record of the run: the md5 of every output and the parameter values each
  stage actually ran with. Tagging from it (not from params.yaml) keeps the version honest even
  if params.yaml was edited after the last `dvc repro`.
- reports/evaluate.json is the evaluate stage's verdict:
  `{"metrics": {...}, "gate": {"passed": bool, "checks": {...}}}`.

What a model version shows (a registry people can read): a handful of tags (`summary_tags`: base,
method, data hash, git commit, primary metric, gate, lineage fingerprint; what trained, `train.<key>`,
from tasks/register/training.py) and a description (`describe`); everything else, every output hash
and every parameter, goes into one JSON document (`lineage_record`), logged as `lineage.json` in the
version's run and named by the version's `lineage` tag. `inputs` (output hashes and stage params,
the register section left out) and its `fingerprint` identify what the model was built from:
`only_if_changed` compares them.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tasks.common.credentials import redact_nested
from tasks.common.errors import UserError
from tasks.common.tracking import flatten

#: Outputs whose hashes identify the data and the model (the issue's lineage minimum).
KEY_OUTPUTS = ("data/processed", "models/finetuned", "models/openvino")

#: MLflow caps a model version tag value at 5000 characters.
_TAG_VALUE_MAX = 5000


@dataclass(frozen=True)
class Lock:
    """What dvc.lock says: output path -> md5, and stage -> the params it ran with."""

    hashes: dict[str, str]
    params: dict[str, Any]


@dataclass(frozen=True)
class Evaluation:
    metrics: dict[str, float]
    passed: bool
    checks: dict[str, Any] = field(default_factory=dict)
    #: the report's `protocol` section (tasks/evaluate/protocol.py): id, calibrated, settings
    protocol: dict[str, Any] | None = None

    @property
    def protocol_id(self) -> str | None:
        return (self.protocol or {}).get("id")

    @property
    def uncalibrated(self) -> str | None:
        """Why the scores are uncalibrated, or None (calibrated, or a report without protocol)."""
        if self.protocol and not self.protocol.get("calibrated", True):
            return str(self.protocol.get("uncalibrated_reason") or "uncalibrated scores")
        return None

    def protocol_tag(self) -> str:
        """`<id> (calibrated)` / `<id> (uncalibrated)`: the version tag `protocol`."""
        if not self.protocol_id:
            return "unknown (the report has no protocol section)"
        return f"{self.protocol_id} ({'uncalibrated' if self.uncalibrated else 'calibrated'})"


def read_lock(path: Path, required: tuple[str, ...] = KEY_OUTPUTS) -> Lock:
    """Parse dvc.lock; fail with the fix when it is missing or lacks a required output."""
    path = Path(path)
    if not path.is_file():
        raise UserError(
            f"{path} not found: run the pipeline first (`dvc repro` or the finetune flow)"
        )
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise UserError(f"{path} is not valid YAML: {err}") from err
    hashes: dict[str, str] = {}
    params: dict[str, Any] = {}
    for stage in (data.get("stages") or {}).values():
        for out in stage.get("outs") or []:
            if out.get("md5"):
                hashes[str(out["path"])] = str(out["md5"])
        for section_values in (stage.get("params") or {}).values():  # {params.yaml: {base: {...}}}
            for key, value in (section_values or {}).items():
                _set_dotted(params, key, value)  # single keys (train's `register.primary_metric`) nest
    missing = [p for p in required if p not in hashes]
    if missing:
        raise UserError(
            f"{path} has no hash for {', '.join(missing)}: the stages producing them have not run; "
            "run `dvc repro` first"
        )
    return Lock(hashes=hashes, params=redact_nested(params))  # launch.env secrets never leave


def _set_dotted(params: dict[str, Any], key: str, value: Any) -> None:
    """params[key] = value, where a dotted key (a stage tracking one key of another section) nests."""
    *parents, last = str(key).split(".")
    for part in parents:
        if not isinstance(params.get(part), dict):
            params[part] = {}
        params = params[part]
    params[last] = value


def read_evaluation(path: Path) -> Evaluation:
    """Read the evaluate stage's report; `gate.passed` must be a bool."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path} not found: run the evaluate stage first (`dvc repro evaluate`)")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise UserError(f"{path} is not valid JSON: {err}") from err
    gate = data.get("gate") if isinstance(data, dict) else None
    if not isinstance(gate, dict) or not isinstance(gate.get("passed"), bool):
        raise UserError(
            f"{path}: expected a boolean at 'gate.passed' (written by the evaluate stage)"
        )
    metrics = {
        k: float(v)
        for k, v in flatten(data.get("metrics") or {}).items()
        if isinstance(v, (int, float)) and not isinstance(v, bool)
    }
    protocol = data.get("protocol")
    return Evaluation(metrics=metrics, passed=gate["passed"], checks=dict(gate.get("checks") or {}),
                      protocol=protocol if isinstance(protocol, dict) else None)


def _tag_value(value: Any) -> str:
    if isinstance(value, float) and math.isfinite(value):
        text = repr(value)
    elif isinstance(value, (dict, list)):
        text = json.dumps(value, sort_keys=True)
    else:
        text = "null" if value is None else str(value)
    return text[:_TAG_VALUE_MAX]


def inputs(lock: Lock) -> dict[str, str]:
    """What the model was built from, flat: `dvc.md5.<out>` and `param.<stage key>` (tag values)."""
    flat: dict[str, Any] = {f"dvc.md5.{p}": h for p, h in sorted(lock.hashes.items())}
    flat.update({f"param.{k}": v for k, v in flatten(lock.params).items()
                 if not k.startswith("register.")})
    return {k: _tag_value(v) for k, v in sorted(flat.items())}


def fingerprint(built_from: dict[str, str]) -> str:
    """A short, stable id of `inputs(...)`: equal fingerprints, same data, models and params."""
    text = json.dumps(built_from, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def lineage_record(
    lock: Lock,
    evaluation: Evaluation,
    params: dict[str, Any],
    git_commit: str | None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The full lineage of a version, as one JSON document (`lineage.json`).

    `params` (the register section) are merged over the stage params read from dvc.lock.
    """
    built_from = inputs(lock)
    return {
        "git_commit": git_commit,
        "outputs": dict(sorted(lock.hashes.items())),
        "params": {**lock.params, **params},
        "metrics": dict(sorted(evaluation.metrics.items())),
        "gate": {"passed": evaluation.passed, "checks": evaluation.checks},
        "protocol": evaluation.protocol,
        "inputs": built_from,
        "fingerprint": fingerprint(built_from),
        **({"extra": extra} if extra else {}),
    }


def summary_tags(
    lock: Lock,
    evaluation: Evaluation,
    git_commit: str | None,
    primary_metric: str,
    extra: dict[str, Any] | None = None,
) -> dict[str, str]:
    """The few tags a version shows in the registry's versions table."""
    p = flatten(lock.params)
    tags: dict[str, Any] = {
        "base": p.get("base.model", "?"),
        "method": p.get("train.method", "?"),
        "data": lock.hashes.get("data/processed", "?"),
        "git_commit": git_commit or "unknown (not a git checkout)",
        f"metric.{primary_metric}": evaluation.metrics.get(primary_metric),
        "gate": "passed" if evaluation.passed else "failed",
        "protocol": evaluation.protocol_tag(),
        "lineage.fingerprint": fingerprint(inputs(lock)),
    }
    tags.update(extra or {})
    return {k: _tag_value(v) for k, v in tags.items()}


def describe(lock: Lock, evaluation: Evaluation, git_commit: str | None,
             primary_metric: str | None = None, trained: str = "") -> str:
    """One readable paragraph for the version's description in the registry UI; `trained`: what
    trained, in one line (tasks/register/training.py)."""
    p = flatten(lock.params)
    base = p.get("base.model", "?")
    method = p.get("train.method", "?")
    steps = p.get("train.max_train_steps", "?")
    scores = ", ".join(f"{k}={v:.4g}" for k, v in sorted(evaluation.metrics.items())
                       if primary_metric is None or k in (primary_metric, "clip_t", "clip_i"))
    verdict = "passed" if evaluation.passed else "did not pass"
    warning = evaluation.uncalibrated
    return (
        (f"{warning[0].upper()}{warning[1:]}. " if warning else "")
        + f"{base} fine-tuned with {method} for {steps} steps{f': {trained}' if trained else ''}. "
        f"Evaluation: {scores or 'no metrics'}; the gate {verdict}; protocol "
        f"{evaluation.protocol_tag()}. "
        f"Artifacts: the diffusers pipeline (finetuned/) and its OpenVINO export (openvino/); "
        f"predict() uses OpenVINO when optimum-intel is installed. "
        f"Data {lock.hashes.get('data/processed', '?')}, "
        f"model {lock.hashes.get('models/finetuned', '?')}, "
        f"git {git_commit or 'unknown'}. Full lineage: lineage.json in the source run."
    )
