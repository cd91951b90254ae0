"""Print where to look after a pipeline run: MLflow UI, registered model and aliases, outputs.

`make demo` ends with `python -m flows.summary`.
"""
from __future__ import annotations

import json
from pathlib import Path

from flows.params import stage_output
from tasks.common.tracking import tracking_uri


def _size(path: Path) -> str:
    total = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return f"{total / 2**20:.1f} MiB"


def registered_name(root: Path) -> str:
    """The registered model this workspace's run went to: `register.model_name`, or the name that
    follows what was trained (tasks/register/naming.py)."""
    from tasks.register.naming import planned

    dvc_yaml = root / "dvc.yaml"
    report, base = stage_output(dvc_yaml, "train", "--report"), stage_output(dvc_yaml, "base", "--out")
    return planned(root / "params.yaml", root / report if report else None,
                   root / base if base else None) or "(not known: the base stage has not run)"


def summary(root: Path = Path(".")) -> str:
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    name = registered_name(root)
    uri = tracking_uri(root)
    lines = ["", "Pipeline finished. Where to look:", ""]
    lines.append(f"  MLflow UI          make mlflow-ui   (then open http://127.0.0.1:5000; store {uri})")
    try:
        model = MlflowClient(tracking_uri=uri).get_registered_model(name)
        versions = MlflowClient(tracking_uri=uri).search_model_versions(f"name='{name}'")
        latest = max(int(v.version) for v in versions) if versions else None
        aliases = ", ".join(f"@{a} -> v{v}" for a, v in sorted(model.aliases.items())) or "none"
        lines.append(f"  Registered model   {name} (latest v{latest}; aliases {aliases})")
        lines.append(f"                     mlflow.pyfunc.load_model('models:/{name}@candidate')"
                     ".predict(['a photo of sks toy'])")
    except MlflowException:
        lines.append(f"  Registered model   {name}: not registered yet")
    dvc_yaml = root / "dvc.yaml"  # the one place output paths are written
    for label, stage in [("Fine-tuned model", "train"), ("OpenVINO export", "export")]:
        rel = stage_output(dvc_yaml, stage, "--out")
        if rel is None:
            continue
        path = root / rel
        lines.append(f"  {label:<18} {rel}/ ({_size(path)})" if path.is_dir() else f"  {label:<18} {rel}/ missing")
    report, grids = stage_output(dvc_yaml, "evaluate", "--report"), stage_output(dvc_yaml, "evaluate", "--out")
    if report is not None and (root / report).is_file():
        data = json.loads((root / report).read_text())
        metrics = ", ".join(f"{k}={v:.3f}" for k, v in sorted(data.get("metrics", {}).items())
                            if isinstance(v, (int, float)))
        gate = data.get("gate", {}).get("passed")
        lines.append(f"  Evaluation report  {report} (gate {'passed' if gate else 'failed'}; {metrics})")
        if grids is not None:
            lines.append(f"  Evaluation grid    {grids / 'grid.png'}")
        fidelity = data.get("export_fidelity")
        if fidelity:  # the export against the PyTorch fine-tune: apart from the gains above
            lines.append(f"  Export fidelity    {fidelity['backend']} vs PyTorch fp32 fine-tune: "
                         f"PSNR mean {fidelity['psnr_mean']:.1f} dB, min {fidelity['psnr_min']:.1f}"
                         f" dB; DINO {fidelity['delta_dino']:+.4f}, CLIP-I "
                         f"{fidelity['delta_clip_i']:+.4f}, CLIP-T {fidelity['delta_clip_t']:+.4f}")
        protocol = data.get("protocol") or {}
        if protocol:
            lines.append(f"  Eval protocol      {protocol.get('id')} "
                         f"({'calibrated' if protocol.get('calibrated') else 'UNCALIBRATED'})")
        if protocol and not protocol.get("calibrated", True):
            lines.append(f"  WARNING            {protocol.get('uncalibrated_reason')}")
    lines.append("  Pipeline status    .venv/bin/dvc status  |  .venv/bin/dvc metrics show")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(summary())
