"""A small pyfunc registered in tasks/register's order (log, manifest, lineage.json, version, lineage
digest, champion), the way to rewrite one of its stored files (MLflow's own artifact repository:
a local store's folder, or the server's artifact proxy), and this project's `models:/` entry point
visible to a fresh process without installing the project (tests/register/test_manifest.py,
tests/infra/test_team_stack.py)."""
from __future__ import annotations

import contextlib
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlflow

from tasks.register import manifest, verified
from tasks.register.registry import CHAMPION, LINEAGE_ARTIFACT
from tests.conftest import REPO

MODEL_CODE = """
import mlflow

class Echo(mlflow.pyfunc.PythonModel):
    def load_context(self, context):
        import helper
        self.prefix = open(context.artifacts["weights"]).read().strip()

    def predict(self, context, model_input: list[str], params=None) -> list[str]:
        return [f"{self.prefix}:{x}" for x in model_input]

mlflow.models.set_model(Echo())
"""


def register_echo(tmp_path: Path, name: str, experiment_id: str | None = None,
                  manifested: bool = True) -> tuple[Any, str]:
    """A new version of `name` holding `champion`, its predictions "w1:<input>"; (the version,
    the artifact URI of its stored files)."""
    (tmp_path / "model_code.py").write_text(MODEL_CODE)
    (tmp_path / "helper.py").write_text("VALUE = 1\n")
    (tmp_path / "weights.safetensors").write_text("w1\n")
    client = mlflow.MlflowClient()
    with mlflow.start_run(experiment_id=experiment_id) as active:
        info = mlflow.pyfunc.log_model(name="model", python_model=str(tmp_path / "model_code.py"),
                                       artifacts={"weights": str(tmp_path / "weights.safetensors")},
                                       code_paths=[str(tmp_path / "helper.py")], pip_requirements=[])
    run = active.info.run_id
    if manifested:
        manifest.record_logged(client, run, info)
    if not client.search_registered_models(f"name='{name}'"):
        client.create_registered_model(name)
    mv = client.create_model_version(name, source=info.model_uri, run_id=run, model_id=info.model_id)
    owner = {"name": name, "version": str(mv.version), "run_id": run, "source": info.model_uri}
    client.log_dict(run, {"metrics": {"dino": 0.4}, "protocol": {"id": "p1"}, "model": owner}, LINEAGE_ARTIFACT)
    if manifested:
        manifest.record_lineage(client, run, info.model_uri, LINEAGE_ARTIFACT)
    client.set_registered_model_alias(name, CHAMPION, mv.version)
    return mv, client.get_logged_model(info.model_id).artifact_location


def rewrite(location: str, file: str, data: bytes, work: Path) -> bytes:
    """Overwrite `file` of the model stored at `location` with `data` through MLflow's artifact
    repository for it (what anyone allowed to write the run's artifacts can do); the old bytes."""
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

    repo = get_artifact_repository(location)
    work.mkdir(parents=True, exist_ok=True)
    old = Path(repo.download_artifacts(file, str(work))).read_bytes()
    new = work / "new" / Path(file).name
    new.parent.mkdir(exist_ok=True)
    new.write_bytes(data)
    repo.log_artifact(str(new), str(Path(file).parent) if "/" in file else None)
    return old


def entry_point_path(tmp_path: Path) -> Path:
    """A folder that, first on PYTHONPATH, gives a fresh process pyproject.toml's
    `mlflow.artifact_repository` entry points, as `pip install -e .` would."""
    points = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]
    info = tmp_path / "entry-points" / "sd_finetune_entry_points-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sd-finetune-entry-points\nVersion: 0\n")
    lines = [f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in items.items()) for group, items in points.items()]
    (info / "entry_points.txt").write_text("\n".join(lines))
    return info.parent


@contextlib.contextmanager
def verifying() -> Iterator[None]:
    """`models:/` resolved by the verifying repository in this process (what the entry point does
    where the project is installed); what was registered before, afterwards."""
    from mlflow.store.artifact.artifact_repository_registry import (
        _artifact_repository_registry,
        get_registered_artifact_repositories,
    )

    before = get_registered_artifact_repositories()["models"]
    verified.use()
    try:
        yield
    finally:
        _artifact_repository_registry.register("models", before)
