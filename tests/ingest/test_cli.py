"""`python -m tasks.ingest` as dvc.yaml runs it, on the demo images, with a real MLflow store."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml
from mlflow.tracking import MlflowClient

from tasks.common.outputs import OUTPUT_KIND, OUTPUT_MARKER
from tasks.common.safe_remove import mark
from tests.conftest import REPO
from tests.ingest.util import read_jsonl


def write_params(path: Path, sources: list[dict], **overrides) -> Path:
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    # The sources name their own folders (under tmp), so no data_dir to lie inside.
    params["ingest"] = {**params["ingest"], "data_dir": None, "sources": sources, **overrides}
    path.write_text(yaml.safe_dump(params))
    return path


def folder(path: Path | str) -> list[dict]:
    return [{"type": "folder", "path": str(path)}]


def run_cli(cwd: Path, params: Path, **env: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, "-m", "tasks.ingest", "--out", "data/processed",
        "--report", "reports/ingest.json", "--rejected", "reports/ingest_rejected.jsonl",
        "--params", str(params),
    ]
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **env}
    return subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=300)


def test_cli_on_demo_data_writes_outputs_and_logs_a_run(tmp_path: Path, isolated_mlflow: str):
    demo = tmp_path / "subject"
    generate = [sys.executable, str(REPO / "data/demo/generate.py"), "--out", str(demo)]
    subprocess.run(generate, check=True, capture_output=True)
    (demo / "junk.png").write_bytes(b"")  # one bad file, to see it reported
    proc = run_cli(tmp_path, write_params(tmp_path / "params.yaml", folder(demo)))
    assert proc.returncode == 0, proc.stderr

    report = json.loads((tmp_path / "reports/ingest.json").read_text())
    assert (report["total"], report["kept"], report["rejected"]) == (7, 6, 1)
    assert report["rejected_by_reason"]["empty_file"] == 1
    assert report["by_source"] == {str(demo): {"total": 7, "kept": 6}}
    rejected = read_jsonl(tmp_path / "reports/ingest_rejected.jsonl")
    assert [(r["path"], r["reason"]) for r in rejected] == [("junk.png", "empty_file")]
    rows = read_jsonl(tmp_path / "data/processed/metadata.jsonl")
    assert len(rows) == 6 and all("sks toy" in r["text"] for r in rows)
    pngs = sorted(p.name for p in (tmp_path / "data/processed").glob("*.png"))
    assert pngs == sorted(r["file_name"] for r in rows)
    assert len(list((tmp_path / ".cache/ingest").glob("*/*/*.png"))) == 6  # the default cache

    client = MlflowClient(tracking_uri=isolated_mlflow)
    exp = client.get_experiment_by_name("finetune")
    (run,) = client.search_runs([exp.experiment_id], "tags.stage = 'ingest'")
    assert run.info.status == "FINISHED"
    metrics = run.data.metrics
    assert metrics["kept"] == 6 and metrics["rejected.empty_file"] == 1 and metrics["cache_hits"] == 0
    assert run.data.params["resolution"] == "64" and str(demo) in run.data.params["sources"]
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    expected = {"ingest_samples.png", "ingest.json", "ingest_rejected.jsonl", "metadata.jsonl"}
    assert expected <= artifacts


def test_cli_without_usable_images_fails_cleanly_and_keeps_old_output(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "broken.png").write_text("not a png")
    old = mark(tmp_path / "data/processed", OUTPUT_KIND, OUTPUT_MARKER)  # an earlier run's output
    (old / "metadata.jsonl").write_text('{"previous": true}\n')
    proc = run_cli(tmp_path, write_params(tmp_path / "params.yaml", folder(src), cache_dir=None))
    assert proc.returncode == 2
    assert "no usable images" in proc.stderr and "Traceback" not in proc.stderr
    # The previous output is untouched: no half-written copy replaced it.
    assert (old / "metadata.jsonl").read_text() == '{"previous": true}\n'
    assert not (tmp_path / "reports/ingest.json").exists()
    assert "not_an_image" in (tmp_path / "reports/ingest_rejected.jsonl").read_text()
    leftovers = [p for d in ("data", "reports") for p in (tmp_path / d).iterdir() if p.name.startswith(".")]
    assert not leftovers  # no temp files or dirs


def test_cli_missing_source_says_make_data(tmp_path: Path) -> None:
    proc = run_cli(tmp_path, write_params(tmp_path / "params.yaml", folder("data/demo/subject")))
    assert proc.returncode == 2
    assert "ingest.sources.0.path: data/demo/subject does not exist" in proc.stderr
    assert "make data" in proc.stderr
    assert not (tmp_path / "data/processed").exists()


def test_cli_under_dvc_refuses_a_source_missing_from_deps(tmp_path: Path) -> None:
    (tmp_path / "photos").mkdir()
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump(
        {"stages": {"ingest": {"cmd": "python -m tasks.ingest", "deps": ["tasks/ingest"]}}}))
    params = write_params(tmp_path / "params.yaml", folder("photos"))
    proc = run_cli(tmp_path, params, DVC_STAGE="ingest", DVC_ROOT=str(tmp_path))
    assert proc.returncode == 2
    assert "photos is not a dependency of the DVC stage 'ingest'" in proc.stderr
    assert "      - photos" in proc.stderr
