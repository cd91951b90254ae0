"""After the runs: what the registry holds, read from PostgreSQL (MLflow's tables) and through
the MLflow server (each version's files), held against what each run's rerun said it left.

- lost: a run whose rerun succeeded, yet no version carries the workspace's lineage fingerprint.
- duplicated: versions beyond the first with one lineage fingerprint (each run changes the seed,
  so every fingerprint is built once; a rerun must recognise what its killed run registered).
- half-registered: a version not READY (PENDING_REGISTRATION, FAILED_REGISTRATION), without its
  model files (MLmodel) or its lineage.json, whose lineage.json names another fingerprint or does
  not name the version, or still tagged `registration=incomplete` (tasks/register/resume.py); an
  alias pointing at a missing version; an MLflow run left RUNNING.
- candidate behind: after a successful rerun, `candidate` is not on that change's version.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

FINGERPRINT_TAG = "lineage.fingerprint"


@dataclass
class Registry:
    """What the audit reads: versions {version: {status, run_id, fingerprint, problems}},
    aliases {alias: version}, runs left RUNNING [(run_id, name)]."""
    versions: dict[str, dict[str, Any]] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    running: list[tuple[str, str]] = field(default_factory=list)


def gather(pg: Any, uri: str, model: str) -> Registry:
    """Read the registry of `model` from PostgreSQL `pg` and the MLflow server at `uri`."""
    import mlflow

    mlflow.set_tracking_uri(uri)  # `models:/` and `runs:/` resolve through these, not arguments
    mlflow.set_registry_uri(uri)
    reg = Registry()
    rows = pg.query("mlflow", "select version, status, run_id from model_versions "
                              f"where name = '{model}'")
    tags = dict(pg.query("mlflow", "select version, value from model_version_tags where "
                                   f"name = '{model}' and key = '{FINGERPRINT_TAG}'"))
    cut = {v for v, value in pg.query("mlflow", "select version, value from model_version_tags where "
                                                f"name = '{model}' and key = 'registration'") if value != "complete"}
    for version, status, run_id in rows:
        problems = _file_problems(uri, model, version, tags.get(version))
        problems += ["registration=incomplete: cut off, never finished"] if version in cut else []
        reg.versions[str(version)] = {"status": status, "run_id": run_id,
                                      "fingerprint": tags.get(version), "problems": problems}
    reg.aliases = {alias: str(version) for alias, version in pg.query(
        "mlflow", f"select alias, version from registered_model_aliases where name = '{model}'")}
    reg.running = [(run, name) for run, name in pg.query(
        "mlflow", "select run_uuid, name from runs where status = 'RUNNING' "
                  "and lifecycle_stage = 'active'")]
    return reg


def _file_problems(uri: str, model: str, version: Any, fp: str | None) -> list[str]:
    """What is missing of a version's files: the model (MLmodel) and a matching lineage.json."""
    import mlflow

    problems = []
    try:
        names = {a.path for a in mlflow.artifacts.list_artifacts(f"models:/{model}/{version}")}
        if "MLmodel" not in names:
            problems.append("no MLmodel")
    except Exception as err:  # any failure to read is the finding
        problems.append(f"model files unreadable: {str(err)[:120]}")
    client = mlflow.MlflowClient(uri)
    try:
        lineage = client.get_model_version(model, str(version)).tags.get("lineage")
        record = mlflow.artifacts.load_dict(lineage) if lineage else None
        if record is None:
            problems.append("no lineage tag")
        elif record.get("fingerprint") != fp:
            problems.append(f"lineage.json fingerprint {record.get('fingerprint')} != tag {fp}")
        elif str((record.get("model") or {}).get("version")) != str(version):
            problems.append(f"lineage.json names version {(record.get('model') or {}).get('version')}")
    except Exception as err:
        problems.append(f"lineage.json unreadable: {str(err)[:120]}")
    return problems


def summarize(runs: list[dict[str, Any]], reg: Registry) -> dict[str, Any]:
    """The table's figures from the per-run records and the registry."""
    counts = Counter(v["fingerprint"] for v in reg.versions.values())
    succeeded = [r for r in runs if r.get("rerun_state") == "Completed"]
    lost = [r["run"] for r in succeeded if r.get("fingerprint") not in counts]
    duplicated = {fp: n for fp, n in counts.items() if n > 1}
    half = [f"v{v}: {info['status']}" for v, info in reg.versions.items()
            if info["status"] != "READY"]
    half += [f"v{v}: {p}" for v, info in reg.versions.items() for p in info["problems"]]
    half += [f"alias {a} -> missing v{v}" for a, v in reg.aliases.items()
             if v not in reg.versions]
    half += [f"run {run_id} ({name}) left RUNNING" for run_id, name in reg.running]
    behind = [r["run"] for r in succeeded
              if r.get("candidate_fingerprint") != r.get("fingerprint")]
    recoveries = [r["recovery_s"] for r in runs if r.get("recovery_s") is not None]
    return {
        "runs": len(runs),
        "kills": sum(1 for r in runs if r.get("killed")),
        "reruns_failed": [r["run"] for r in runs if r.get("rerun_state") != "Completed"],
        "versions": len(reg.versions),
        "lost": lost,
        "duplicated": duplicated,
        "half_registered": half,
        "candidate_behind": behind,
        "longest_recovery_s": round(max(recoveries), 1) if recoveries else None,
        "aliases": reg.aliases,
    }
