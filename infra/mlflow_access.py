"""Who may do what on the team's MLflow server (basic-auth app, infra/mlflow/auth.ini).

Run with the admin's credentials in the environment (MLFLOW_TRACKING_USERNAME=admin,
MLFLOW_TRACKING_PASSWORD) and MLFLOW_TRACKING_URI pointing at the server:

    python infra/mlflow_access.py bootstrap            # compose's mlflow-init runs this once
    python infra/mlflow_access.py add-user NAME --role reader|pipeline   # password asked for

`bootstrap` creates the pipeline's user (password from MLFLOW_PIPELINE_PASSWORD) and the
registered model (REGISTERED_MODEL, params.yaml's register.model_name), on which that user holds
EDIT: it registers versions, tags them and moves their aliases, but cannot delete them. Everyone
else reads (the server's default_permission). Running it again changes nothing that exists.
`add-user` reads the new password from the terminal or stdin, never from the command line.
"""
from __future__ import annotations

import argparse
import getpass
import os
import sys

PIPELINE_USER = "pipeline"
#: params.yaml's register.model_name unless the stack names another.
DEFAULT_MODEL = "sd-finetuned"
PIPELINE_PERMISSION = "EDIT"


def _client():
    from mlflow.server import get_app_client

    return get_app_client("basic-auth", tracking_uri=os.environ["MLFLOW_TRACKING_URI"])


def _unless_exists(call, *args: str) -> bool:
    """call(*args); False when what it creates exists already (running again changes nothing)."""
    from mlflow.exceptions import MlflowException

    try:
        call(*args)
    except MlflowException as err:
        if err.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
        return False
    return True


def ensure_user(username: str, password: str) -> bool:
    """Create `username` unless it exists; True when created."""
    return _unless_exists(_client().create_user, username, password)


def ensure_model(name: str) -> None:
    import mlflow

    _unless_exists(mlflow.MlflowClient().create_registered_model, name)


def grant_model(username: str, model: str, permission: str) -> None:
    """Grant `permission` on `model`; a grant that exists is kept as an admin may have changed it."""
    _unless_exists(_client().grant_user_permission, username, "registered_model", model,
                   permission)


def bootstrap() -> None:
    password = os.environ.get("MLFLOW_PIPELINE_PASSWORD", "")
    if not password:
        sys.exit("error: MLFLOW_PIPELINE_PASSWORD is not set: set it in infra/.env")
    model = os.environ.get("REGISTERED_MODEL") or DEFAULT_MODEL
    created = ensure_user(PIPELINE_USER, password)
    ensure_model(model)
    grant_model(PIPELINE_USER, model, PIPELINE_PERMISSION)
    print(f"user '{PIPELINE_USER}' {'created' if created else 'exists'}; it holds "
          f"{PIPELINE_PERMISSION} on registered model '{model}'; others read")


def add_user(username: str, role: str, model: str) -> None:
    if sys.stdin.isatty():
        password = getpass.getpass(f"password for {username}: ")
    else:
        password = sys.stdin.readline().rstrip("\n")
    if len(password) < 12:
        sys.exit("error: the password must have at least 12 characters")
    if not ensure_user(username, password):
        sys.exit(f"error: user '{username}' exists; change its password with "
                 "mlflow.server.get_app_client('basic-auth').update_user_password")
    if role == "pipeline":
        grant_model(username, model, PIPELINE_PERMISSION)
    print(f"user '{username}' created as {role}"
          + (f" ({PIPELINE_PERMISSION} on '{model}')" if role == "pipeline" else " (reads)"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("bootstrap", help="the pipeline's user and its registered model")
    add = sub.add_parser("add-user", help="a user; the password is read from stdin")
    add.add_argument("username")
    add.add_argument("--role", choices=["reader", "pipeline"], default="reader")
    add.add_argument("--model", default=os.environ.get("REGISTERED_MODEL") or DEFAULT_MODEL)
    args = parser.parse_args(argv)
    if args.command == "bootstrap":
        bootstrap()
    else:
        add_user(args.username, args.role, args.model)


if __name__ == "__main__":
    main()
