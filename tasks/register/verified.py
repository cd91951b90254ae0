"""Loads that check a registered model's files against its manifest (tasks/register/manifest.py).

The check cannot live in the model: its python_model file, `code/` and MLmodel are artifacts the
pipeline user can rewrite. It lives in this installed package, in MLflow's resolver of `models:/`
URIs: `VerifiedModelsArtifactRepository` downloads like MLflow's own, then compares what it
downloaded with the manifest of the version (or logged model) the URI names, before MLflow reads
MLmodel or runs any of the model's code. It reaches MLflow in three ways:

- the entry point `mlflow.artifact_repository: models` in pyproject.toml, active in any process
  of an environment where this project is installed (`pip install -e .`): `mlflow.pyfunc.load_model`,
  `mlflow.artifacts.download_artifacts`, `mlflow models serve` on a `models:/` URI;
- `use()`, which registers it in this process, whatever is installed;
- `python -m tasks.register.verified <mlflow arguments>`: MLflow's CLI with it registered
  (`make serve-model` runs `models serve` this way, its server behind a request body limit:
  tasks/register/serve_app.py), and `download()` (the re-scoring flow).

Not covered: a process without this project installed (a plain MLflow install loads any file);
URIs that bypass `models:/` (`runs:/...`, the artifact store's own `mlflow-artifacts:/`, `s3://`
or file paths); files a served model downloads itself at run time in an environment without the
entry point (a base export's endpoint fetching adapters); a file changed on the local disk after
the check and before MLflow reads it.

Its downloads show no "Downloading artifacts" bars (up to one line per file, before the model's
own code runs: finetune_runtime/quiet.py quiets the rest), unless the environment sets
`MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR` or `LOG_LEVEL=DEBUG`.
"""
from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mlflow.store.artifact.models_artifact_repo import ModelsArtifactRepository

from tasks.register import manifest

#: MLflow's switch for its download bars, read at each download
BARS_ENV = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"


@contextlib.contextmanager
def bars_off() -> Iterator[None]:
    """MLflow's download bars off inside, unless the environment sets BARS_ENV or LOG_LEVEL=DEBUG."""
    if BARS_ENV in os.environ or os.environ.get("LOG_LEVEL", "").strip().upper() == "DEBUG":
        yield
        return
    os.environ[BARS_ENV] = "false"
    try:
        yield
    finally:
        os.environ.pop(BARS_ENV, None)


class VerifiedModelsArtifactRepository(ModelsArtifactRepository):
    """MLflow's `models:/` repository, refusing a download that differs from the registered manifest."""

    def download_artifacts(self, artifact_path: str, dst_path: str | None = None,
                           lineage_header_info: Any = None) -> str:
        with bars_off():
            path = super().download_artifacts(artifact_path, dst_path, lineage_header_info)
            files = self.registered_files()
        if files is not None:
            manifest.compare(files, path, artifact_path, self.describe())
        return path

    def describe(self) -> str:
        if self.model_name:
            return f"registered model {self.model_name} version {self.model_version}"
        return f"logged model {self.artifact_uri}"

    def registered_files(self) -> dict[str, str] | None:
        """The manifest's {file: SHA-256} of the model this URI names (None: registered without one)."""
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=self.tracking_uri, registry_uri=self.registry_uri)
        if self.model_name:
            mv = client.get_model_version(self.model_name, str(self.model_version))
            return manifest.expected(client, mv.run_id, mv.source, self.describe())
        model_id = self.artifact_uri.split("models:/", 1)[-1].split("/", 1)[0]
        logged = client.get_logged_model(model_id)
        return manifest.expected(client, logged.source_run_id, f"models:/{model_id}", self.describe())


def use() -> None:
    """Resolve `models:/` URIs with the verifying repository in this process."""
    from mlflow.store.artifact.artifact_repository_registry import _artifact_repository_registry

    _artifact_repository_registry.register("models", VerifiedModelsArtifactRepository)


def download(model_uri: str, dst_path: str) -> str:
    """`mlflow.artifacts.download_artifacts(model_uri, dst_path=...)`, checked against its manifest."""
    from mlflow.store.artifact.models_artifact_repo import ModelsArtifactRepository as Plain

    root, sub = Plain.split_models_uri(model_uri)
    Path(dst_path).mkdir(parents=True, exist_ok=True)
    return VerifiedModelsArtifactRepository(root).download_artifacts(sub, dst_path)


def main(argv: list[str] | None = None) -> None:
    """MLflow's CLI (`mlflow <argv>`) with `models:/` downloads checked; `models serve` without MLflow's
    INFO lines (the backend it selected, the uvicorn command it runs), unless LOG_LEVEL=DEBUG."""
    import logging

    from mlflow.cli import cli

    use()
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:2] == ["models", "serve"]:
        from tasks.register import serve_app

        try:
            serve_app.serve_here()  # the request body's limit (FINETUNE_SERVE_MAX_BODY_BYTES)
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            sys.exit(2)
        if os.environ.get("LOG_LEVEL", "").strip().upper() != "DEBUG":
            logging.getLogger("mlflow").setLevel(logging.WARNING)
    try:
        cli.main(args=args, prog_name="mlflow")
    except manifest.ManifestMismatch as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
