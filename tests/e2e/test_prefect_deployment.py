"""End to end with the real `prefect`, by the README's commands (its "Orchestration: Prefect"
block, read from docs/orchestration.md): `make serve` (server, work pool, `prefect deploy`, worker) on a free
loopback port in a copy of the repo, then `.venv/bin/prefect deployment run finetune/main
--watch`: the first run's worker is killed (SIGKILL, with everything it started) in the middle of
`train`; serve restarts the worker and marks that run Crashed; the next run skips the finished
stages, resumes training from the checkpoint and registers version 1. Then a run with nothing
changed (everything skipped, the same model does not take `champion`), `finetune/nightly` (up to
date: nothing registered), the model versions, aliases and run-summary artifacts, and a clean stop
on Ctrl-C."""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import yaml

from tests.e2e_util import QUICK_CHECKS, VENV_BIN, copy_repo, e2e_env, free_port
from tests.readme_blocks import README, blocks

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(3600)]

STAGES = ["base", "ingest", "class_images", "train", "export", "evaluate"]


def readme_commands() -> tuple[list[str], str, list[str]]:
    """The README's Prefect block: the serve command, the export line it says serve prints, and
    the deployment run."""
    block = next(b for b in blocks(README.parent / "docs" / "orchestration.md")
                 if "prefect deployment run finetune/main" in b.text)
    serve, export, run = [ln.split("#", 1)[0].strip() for ln in block.text.splitlines() if ln.strip()]
    assert export.startswith("export PREFECT_API_URL=http://127.0.0.1:4200/api"), export
    return shlex.split(serve), export, shlex.split(run)


SERVE, EXPORT, RUN = readme_commands()


class Serve:
    """`python -m flows.serve` in the background; its output collected by a reader thread."""

    def __init__(self, root: Path, env: dict[str, str]) -> None:
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            SERVE, cwd=root, env=env, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, text: str, timeout: float) -> float:
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if text in self.output:
                return time.monotonic() - start
            if self.proc.poll() is not None:
                pytest.fail(f"flows.serve exited with {self.proc.returncode}:\n{self.output[-5000:]}")
            time.sleep(0.5)
        pytest.fail(f"no {text!r} from flows.serve after {timeout} s:\n{self.output[-5000:]}")

    def interrupt(self, timeout: float = 90) -> float:
        start = time.monotonic()
        os.killpg(self.proc.pid, signal.SIGINT)  # what Ctrl-C sends, to the terminal's foreground group
        self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        return time.monotonic() - start

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)


def _kill_worker_mid_train(root: Path, serve: Serve, env: dict[str, str]) -> int:
    """Start a deployment run; once `train` has saved a checkpoint, SIGKILL the worker and every
    process under it (the flow run, `dvc repro`, the training), as a node failure would. Returns
    the step of that checkpoint."""
    import psutil

    watch = subprocess.Popen(RUN,
                             cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 1500
    while not (checkpoints := sorted(root.glob(".cache/train/*/checkpoint-*"))):
        assert time.monotonic() < deadline and watch.poll() is None, serve.output[-5000:]
        time.sleep(0.2)
    (flows_serve,) = [p for p in psutil.Process(serve.proc.pid).children(recursive=True)
                      if "flows.serve" in p.cmdline()]  # under make
    (worker,) = [p for p in flows_serve.children() if "worker" in p.cmdline()]
    tree = [worker, *worker.children(recursive=True)]
    assert any("tasks.train" in " ".join(p.cmdline()) for p in tree), "killed in the middle of train"
    for proc in tree:
        proc.kill()
    serve.wait_for("worker restarted", timeout=300)
    out = watch.communicate(timeout=300)[0]
    assert watch.returncode != 0 and "Crashed" in out, out[-3000:]
    return int(checkpoints[0].name.split("-")[1])


def _deployment_run(root: Path, env: dict[str, str], name: str = "finetune/main"
                    ) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.monotonic()
    proc = subprocess.run(
        [name if arg == "finetune/main" else arg for arg in RUN],
        cwd=root, env=env, capture_output=True, text=True, timeout=3000,
    )
    return proc, time.monotonic() - start


def _artifacts(api: str) -> list[str]:
    """The markdown of every `finetune-summary` artifact on the server at `api`."""
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: api}), get_client(sync_client=True) as prefect:
        found = prefect.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["finetune-summary"])))
    return [a.data for a in found]


def test_deployment_run_registers_a_model(tmp_path_factory: pytest.TempPathFactory) -> None:
    import mlflow

    root = copy_repo(tmp_path_factory.mktemp("prefect-e2e"), params=QUICK_CHECKS)
    (root / ".venv").symlink_to(VENV_BIN.parent)  # as make install leaves it
    port = free_port()
    uri = f"sqlite:///{root / 'mlflow.db'}"
    env = e2e_env(root, PREFECT_PORT=str(port), MLFLOW_TRACKING_URI=uri)
    env.pop("MLFLOW_EXPERIMENT_ID", None)
    env.pop("PREFECT_API_URL", None)
    serve = Serve(root, env)
    try:
        ready_s = serve.wait_for("export PREFECT_API_URL=", timeout=600)
        api = f"http://127.0.0.1:{port}/api"
        assert EXPORT.replace(":4200/", f":{port}/") in serve.output
        assert "prefect deployment run finetune/main" in serve.output
        run_env = {**env, "PREFECT_API_URL": api}

        killed_at = _kill_worker_mid_train(root, serve, run_env)
        first, first_s = _deployment_run(root, run_env)
        assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-4000:] + serve.output[-6000:]
        assert "Completed" in first.stdout

        client = mlflow.MlflowClient(tracking_uri=uri)
        params = yaml.safe_load((root / "params.yaml").read_text())
        from tasks.register.naming import planned  # register.model_name, or the name following what trained

        model_name = planned(root / "params.yaml", root / "reports/train.json", root / "models/base")
        v1 = client.get_model_version_by_alias(model_name, "candidate")
        assert str(v1.version) == "1"  # the killed run registered nothing; this one registered once
        train = yaml.safe_load((root / "reports/train.json").read_text())
        assert train["resumed_from_step"] == killed_at and train["steps"] == params["train"]["max_train_steps"]
        gate = yaml.safe_load((root / "reports/evaluate.json").read_text())["gate"]["passed"]
        assert {a for a in v1.aliases} == ({"candidate", "champion"} if gate else {"candidate"})

        def lineage_of(version):
            path = mlflow.artifacts.download_artifacts(version.tags["lineage"], tracking_uri=uri)
            return json.loads(Path(path).read_text())

        lineage = lineage_of(v1)
        assert lineage["outputs"]["models/openvino"].endswith(".dir") and v1.tags["prefect_flow_run_id"]
        parent = client.get_run(v1.run_id)  # the model is logged in the flow's parent run
        assert parent.data.tags["pipeline"] == "finetune" and parent.info.status == "FINISHED"
        finished_before_kill = ["skipped"] * 3  # base, ingest, class_images: recorded in dvc.lock
        assert [parent.data.tags[f"stage.{s}"] for s in STAGES] == finished_before_kill + ["ran"] * 3
        children = client.search_runs([parent.info.experiment_id],
                                      filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
        assert sorted(r.data.tags["stage"] for r in children) == sorted(STAGES[3:])
        train_runs = client.search_runs([parent.info.experiment_id], filter_string="tags.stage = 'train'")
        assert sorted(r.info.status for r in train_runs) == ["FINISHED", "KILLED"]  # closed by flows.serve

        # Nothing changed: DVC skips every stage, the flow says so, and registers version 2.
        second, second_s = _deployment_run(root, run_env)
        assert second.returncode == 0, second.stdout[-4000:] + serve.output[-6000:]
        v2 = client.get_model_version_by_alias(model_name, "candidate")
        assert str(v2.version) == "2"
        parent2 = client.get_run(v2.run_id)
        assert parent2.data.tags["stages.skipped"] == ",".join(STAGES)
        assert serve.output.count("Finished in state Skipped(") == 3 + len(STAGES)  # resumed run, then this one
        # Same model, same scores: it does not beat the champion, so champion stays where it was.
        assert "champion" not in v2.aliases
        assert v2.tags["champion.decision"].startswith("not promoted")
        assert lineage_of(v2)["champion"]["champion.candidate_score"] == v1.tags["metric.dino"]

        # The nightly deployment with nothing changed: up to date in seconds, no version 3.
        nightly, nightly_s = _deployment_run(root, run_env, "finetune/nightly")
        assert nightly.returncode == 0, nightly.stdout[-4000:] + serve.output[-6000:]
        assert f"only_if_changed: up to date: nothing changed since {model_name} v2" in serve.output
        assert len(client.search_model_versions(f"name='{model_name}'")) == 2
        pages = _artifacts(api)
        assert len(pages) == 3 and any("**Up to date**" in p for p in pages)  # the crashed run wrote none
        assert any(f"[{model_name} version 1](" in p and "## Gate:" in p for p in pages)

        stop_s = serve.interrupt()
        # make waits for flows.serve to stop, then ends by the same SIGINT (as it does in a terminal)
        assert serve.proc.returncode in (0, -signal.SIGINT), serve.output[-3000:]
        assert "stopped the worker and the server" in serve.output
        print(f"\nserve ready {ready_s:.1f} s; resumed deployment run {first_s:.1f} s; "
              f"second (all skipped) {second_s:.1f} s; nightly (up to date) {nightly_s:.1f} s; "
              f"Ctrl-C stop {stop_s:.1f} s")
    finally:
        serve.kill()
