"""`make serve-model`'s server: MLflow's scoring app behind a limit on the request body, checked before
MLflow reads it.

MLflow 3.17's `/invocations` reads the whole body (`await request.body()`) and parses it before the
model sees anything, and neither it nor uvicorn has a body-size setting. Starlette (which MLflow's
FastAPI app runs on) has one, `RequestBodyLimitMiddleware`: a body whose Content-Length is over the
limit is answered 413 "Content Too Large" before any of it is read, a chunked one as soon as it
passes the limit. `python -m tasks.register.verified models serve` (what `make serve-model` runs)
has MLflow start uvicorn on this module's `app` instead of `mlflow.pyfunc.scoring_server.app:app`.

The limit: FINETUNE_SERVE_MAX_BODY_BYTES (bytes; default 65 MiB: four input images of 12 MB,
base64-encoded 16 MiB each, with the prompts and params around them). Plain `mlflow models serve`
has no such limit: put it behind a proxy that sets one (docs/registry.md, "Limits of a served model").
"""
from __future__ import annotations

import os
from typing import Any

MAX_BODY_ENV = "FINETUNE_SERVE_MAX_BODY_BYTES"
DEFAULT_MAX_BODY = 65 * 2**20
#: the app MLflow's `models serve` starts, and this one
MLFLOW_APP = "mlflow.pyfunc.scoring_server.app:app"
APP = "tasks.register.serve_app:app"


def max_body() -> int:
    """The body limit from FINETUNE_SERVE_MAX_BODY_BYTES; a ValueError naming it when it is not a size."""
    raw = os.environ.get(MAX_BODY_ENV, "").strip()
    if not raw:
        return DEFAULT_MAX_BODY
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{MAX_BODY_ENV}={raw!r} is not a number of bytes above 0; set one (default "
                         f"{DEFAULT_MAX_BODY}: four 12 MB images, base64) or unset it")
    return int(raw)


def serve_here() -> None:
    """Make this process's `mlflow models serve` start uvicorn on `app` (checks the limit first)."""
    from mlflow.pyfunc import scoring_server

    max_body()  # a bad setting stops here, before the model is downloaded
    plain = scoring_server.get_cmd

    def get_cmd(*args: Any, **kwargs: Any) -> tuple[str, dict[str, str]]:
        command, env = plain(*args, **kwargs)
        if MLFLOW_APP not in command:
            raise RuntimeError(f"MLflow's serve command no longer names {MLFLOW_APP} ({command!r}): the body "
                               f"limit ({MAX_BODY_ENV}) cannot be applied; tasks/register/serve_app.py needs updating")
        return command.replace(MLFLOW_APP, APP), env

    scoring_server.get_cmd = get_cmd


def __getattr__(name: str) -> Any:
    """`app`, built when uvicorn imports it (importing MLflow's app loads the model)."""
    if name != "app":
        raise AttributeError(name)
    from mlflow.pyfunc.scoring_server.app import app as scoring
    from starlette.middleware.body_limit import RequestBodyLimitMiddleware

    global app
    app = RequestBodyLimitMiddleware(scoring, max_body_size=max_body())
    return app
