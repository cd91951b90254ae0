"""`python -m tasks.ingest` as dvc.yaml runs it, on the demo images, with a real MLflow store."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml
from mlflow.tracking import MlflowClient

from tests.conftest import REPO


def write_params(path: Path, source: Path, **overrides) -> Path:
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["ingest"] = {**params["ingest"], "source": str(source), **overrides}
    path.write_text(yaml.safe_dump(params))
    return path


def run_cli(cwd: Path, params: Path) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, "-m", "tasks.ingest", "--out", "data/processed",
        "--report", "reports/ingest.json", "--rejected", "reports/ingest_rejected.jsonl",
        "--params", str(params),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_cli_on_demo_data_writes_outputs_and_logs_a_run(tmp_path: Path, isolated_mlflow: str):
    demo = tmp_path / "subject"
    generate = [sys.executable, str(REPO / "data/demo/generate.py"), "--out", str(demo)]
    subprocess.run(generate, check=True)
    (demo / "junk.png").write_bytes(b"")  # one bad file, to see it reported
    params = write_params(tmp_path / "params.yaml", demo)
    proc = run_cli(tmp_path, params)
    assert proc.returncode == 0, proc.stderr

    report = json.loads((tmp_path / "reports/ingest.json").read_text())
    assert (report["total"], report["kept"], report["rejected"]) == (7, 6, 1)
    assert report["rejected_by_reason"]["empty_file"] == 1
    rejected = read_jsonl(tmp_path / "reports/ingest_rejected.jsonl")
    assert [(r["path"], r["reason"]) for r in rejected] == [("junk.png", "empty_file")]
    rows = read_jsonl(tmp_path / "data/processed/metadata.jsonl")
    assert len(rows) == 6 and all("sks toy" in r["text"] for r in rows)
    pngs = sorted(p.name for p in (tmp_path / "data/processed").glob("*.png"))
    assert pngs == sorted(r["file_name"] for r in rows)

    client = MlflowClient(tracking_uri=isolated_mlflow)
    exp = client.get_experiment_by_name("finetune")
    (run,) = client.search_runs([exp.experiment_id], "tags.stage = 'ingest'")
    assert run.info.status == "FINISHED"
    assert run.data.metrics["kept"] == 6 and run.data.metrics["rejected.empty_file"] == 1
    assert run.data.params["resolution"] == "64" and run.data.params["source"] == str(demo)
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    expected = {"ingest_samples.png", "ingest.json", "ingest_rejected.jsonl", "metadata.jsonl"}
    assert expected <= artifacts


def test_cli_without_usable_images_fails_cleanly_and_keeps_old_output(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "broken.png").write_text("not a png")
    old = tmp_path / "data/processed"
    old.mkdir(parents=True)
    (old / "metadata.jsonl").write_text('{"previous": true}\n')
    proc = run_cli(tmp_path, write_params(tmp_path / "params.yaml", src))
    assert proc.returncode == 2
    assert "no usable images" in proc.stderr and "Traceback" not in proc.stderr
    # The previous output is untouched: no half-written copy replaced it.
    assert (old / "metadata.jsonl").read_text() == '{"previous": true}\n'
    assert not (tmp_path / "reports/ingest.json").exists()
    assert "not_an_image" in (tmp_path / "reports/ingest_rejected.jsonl").read_text()
    assert not [p for p in (tmp_path / "data").iterdir() if p.name.startswith(".")]  # no temp dirs


def test_cli_missing_source_says_make_data(tmp_path: Path) -> None:
    proc = run_cli(tmp_path, write_params(tmp_path / "params.yaml", Path("data/demo/subject")))
    assert proc.returncode == 2
    assert "data/demo/subject does not exist" in proc.stderr and "make data" in proc.stderr
    assert not (tmp_path / "data/processed").exists()
