"""Who may do what on the team's MLflow server (basic-auth app, infra/mlflow/auth.ini).

Run with the admin's credentials in the environment (MLFLOW_TRACKING_USERNAME=admin,
MLFLOW_TRACKING_PASSWORD) and MLFLOW_TRACKING_URI pointing at the server:

    python infra/mlflow_access.py bootstrap            # compose's mlflow-init runs this once
    python infra/mlflow_access.py add-user NAME --role reader|pipeline   # password asked for

`bootstrap` creates the pipeline's user (password from MLFLOW_PIPELINE_PASSWORD) and what the
pipeline writes to: the experiment (MLFLOW_EXPERIMENT_NAME, default `finetune`), the registered
model (REGISTERED_MODEL: the name a run registers under, `python -m tasks.register.naming`) and
its base exports (`<model>-base`); run it again with another REGISTERED_MODEL for each lineage the
pipeline registers (another family or method: zimage-lora, ...).
The admin creates them, so that nobody else can create them first and own them (MLflow gives
MANAGE, delete included, to whoever creates an experiment or a registered model). The pipeline
holds EDIT on all three: it creates runs, registers versions, tags them and moves their aliases,
but deletes nothing. Everyone else reads (the server's default_permission). Running it again
creates what is missing, keeps a grant an admin changed, and lowers a MANAGE the pipeline holds
on them (made when the pipeline created one of them itself) to EDIT.
`add-user` reads the new password from the terminal or stdin, never from the command line.
"""
from __future__ import annotations

import argparse
import getpass
import os
import sys

PIPELINE_USER = "pipeline"
#: The name the project's params.yaml registers under (register.model_name null: the name follows the
#: family and method, tasks/register/naming.py: the demo's sd-dreambooth) unless the stack names another.
DEFAULT_MODEL = "sd-dreambooth"
#: The pipeline's experiment (tasks/common/tracking.py DEFAULT_EXPERIMENT) unless
#: MLFLOW_EXPERIMENT_NAME names another.
DEFAULT_EXPERIMENT = "finetune"
#: The registered model of the base exports is `<model>-base` (tasks/register/base_export.py).
BASE_SUFFIX = "-base"
PIPELINE_PERMISSION = "EDIT"
#: What the pipeline never keeps on its own resources: MANAGE can delete.
LOWERED = "MANAGE"


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


def ensure_model(name: str) -> bool:
    """Create registered model `name` as the admin unless it exists; True when created."""
    import mlflow

    return _unless_exists(mlflow.MlflowClient().create_registered_model, name)


def ensure_experiment(name: str) -> str:
    """The id of experiment `name`, created as the admin when missing; a deleted one is restored
    (a name held by a deleted experiment cannot be created again)."""
    import mlflow

    client = mlflow.MlflowClient()
    found = client.get_experiment_by_name(name)
    if found is None:
        return client.create_experiment(name)
    if found.lifecycle_stage == "deleted":
        client.restore_experiment(found.experiment_id)
    return found.experiment_id


def pipeline_resources(experiment: str, model: str) -> list[tuple[str, str, str]]:
    """(resource type, id, name) of what the pipeline writes to, each made if missing."""
    resources = [("experiment", ensure_experiment(experiment), f"experiment '{experiment}'")]
    for name in (model, f"{model}{BASE_SUFFIX}"):
        ensure_model(name)
        resources.append(("registered_model", name, f"registered model '{name}'"))
    return resources


def grant(username: str, resource_type: str, resource_id: str, permission: str) -> str:
    """Grant `permission`; a grant that exists is kept (an admin may have changed it), except
    MANAGE, which is lowered to `permission`. What was done, in words."""
    client = _client()
    if _unless_exists(client.grant_user_permission, username, resource_type, resource_id,
                      permission):
        return permission
    held = client.get_user_permission(username, resource_type, resource_id).permission
    if held != LOWERED:
        return f"{held} (kept)"
    client.revoke_user_permission(username, resource_type, resource_id)
    client.grant_user_permission(username, resource_type, resource_id, permission)
    return f"{permission} (lowered from {held})"


def grant_pipeline(username: str, experiment: str, model: str) -> list[str]:
    """`username` gets the pipeline's grants on its experiment and both registered models."""
    return [f"{grant(username, kind, rid, PIPELINE_PERMISSION)} on {name}"
            for kind, rid, name in pipeline_resources(experiment, model)]


def _names() -> tuple[str, str]:
    return (os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT,
            os.environ.get("REGISTERED_MODEL") or DEFAULT_MODEL)


def bootstrap() -> None:
    password = os.environ.get("MLFLOW_PIPELINE_PASSWORD", "")
    if not password:
        sys.exit("error: MLFLOW_PIPELINE_PASSWORD is not set: set it in infra/.env")
    created = ensure_user(PIPELINE_USER, password)
    grants = grant_pipeline(PIPELINE_USER, *_names())
    print(f"user '{PIPELINE_USER}' {'created' if created else 'exists'}; it holds "
          f"{'; '.join(grants)}; others read")


def add_user(username: str, role: str, experiment: str, model: str) -> None:
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
        print(f"user '{username}' created as pipeline: "
              f"{'; '.join(grant_pipeline(username, experiment, model))}")
    else:
        print(f"user '{username}' created as reader (reads)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("bootstrap", help="the pipeline's user, its experiment and registered models")
    add = sub.add_parser("add-user", help="a user; the password is read from stdin")
    add.add_argument("username")
    add.add_argument("--role", choices=["reader", "pipeline"], default="reader")
    experiment, model = _names()
    add.add_argument("--experiment", default=experiment)
    add.add_argument("--model", default=model)
    args = parser.parse_args(argv)
    if args.command == "bootstrap":
        bootstrap()
    else:
        add_user(args.username, args.role, args.experiment, args.model)


if __name__ == "__main__":
    main()
