"""infra/compose.yaml without Docker: it parses, every command's flags exist in the installed
`mlflow`/`prefect` CLIs (their real --help), every environment variable is one the program
reads, image/package pins match requirements.lock, no secret is committed or pasted into a URL,
preflight refuses placeholders, and each MinIO user's policy names its own bucket only."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO

INFRA = REPO / "infra"
COMPOSE = yaml.safe_load((INFRA / "compose.yaml").read_text())
SERVICES = COMPOSE["services"]
# Variables the third-party images read (their documented names), and libpq's password.
IMAGE_ENV = {
    "postgres": {"POSTGRES_USER", "POSTGRES_PASSWORD", "POSTGRES_DB"},
    "minio": {"MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD"},
    "mlflow": {"PGPASSWORD"},
}
# The project's own scripts a service runs: a variable it is given must appear in one of them.
SCRIPTS = {
    "preflight": ["preflight.sh"],
    "postgres": ["postgres/init.sh"],
    "minio-init": ["minio_access.py"],
    "mlflow-init": ["mlflow_access.py"],
}
# botocore's (MLflow's S3 client, and DVC's S3 remote through s3fs): credentials and the endpoint.
BOTO_ENV = {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL_S3"}


def _lock_version(package: str) -> str:
    for line in (REPO / "requirements.lock").read_text().splitlines():
        if line.lower().startswith(f"{package}=="):
            return line.split("==", 1)[1].split("+")[0]
    raise AssertionError(f"{package} not in requirements.lock")


def invocations(command: str) -> list[list[str]]:
    """`mlflow ...` / `prefect ...` command lines in a service's command (also inside sh -c)."""
    words = shlex.split(command)
    if words[:2] == ["/bin/sh", "-c"]:
        return [cmd for part in words[2].split("&&") for cmd in invocations(part.strip())]
    return [words] if words and words[0] in ("mlflow", "prefect") else []


@cache
def cli_help(program: str, *subcommand: str) -> str:
    env_bin = Path(sys.executable).parent
    proc = subprocess.run([str(env_bin / program), *subcommand, "--help"], capture_output=True,
                          text=True, timeout=120, env={"PATH": f"{env_bin}:/usr/bin:/bin",
                                                       "COLUMNS": "200", "HOME": "/tmp"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_the_team_services_are_all_there() -> None:
    assert set(SERVICES) >= {"postgres", "minio", "mlflow", "prefect-server", "worker"}
    init = (INFRA / "postgres/init.sh").read_text()
    mlflow_db = SERVICES["mlflow"]["environment"]["MLFLOW_BACKEND_STORE_URI"]
    prefect_db = SERVICES["prefect-server"]["environment"]
    assert mlflow_db == "postgresql+psycopg2://mlflow@postgres:5432/mlflow"  # password: PGPASSWORD
    assert (prefect_db["PREFECT_SERVER_DATABASE_USER"], prefect_db["PREFECT_SERVER_DATABASE_NAME"]) \
        == ("prefect", "prefect")
    for sql in ("CREATE DATABASE mlflow OWNER mlflow;", "CREATE DATABASE mlflow_auth OWNER mlflow;",
                "CREATE DATABASE prefect OWNER prefect;"):
        assert sql in init
    assert "--artifacts-destination s3://" in SERVICES["mlflow"]["command"]
    assert "--app-name basic-auth" in SERVICES["mlflow"]["command"]
    assert SERVICES["worker"]["environment"]["MLFLOW_TRACKING_URI"] == "http://mlflow:5000"


@pytest.mark.parametrize("service", ["mlflow", "prefect-server"])
def test_command_flags_exist_in_the_installed_clis(service: str) -> None:
    found = invocations(SERVICES[service]["command"])
    assert found, f"{service}: no mlflow/prefect command found"
    for words in found:
        # Subcommand words come before the first flag; later bare words are flag values.
        first_flag = next((i for i, w in enumerate(words) if w.startswith("-")), len(words))
        # ... minus positional arguments (the pool name, a limit)
        sub = [w for w in words[1:first_flag] if w != "finetune" and not w.isdigit()]
        text = cli_help(words[0], *sub)
        for flag in (w.split("=")[0] for w in words[first_flag:] if w.startswith("--")):
            assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text), \
                f"{service}: `{' '.join(words[:first_flag])}` has no {flag}"


def test_the_worker_runs_make_serves_machinery_on_the_team_server() -> None:
    """One source for the pool, its limit, the deployments and the worker: flows/serve.py, which
    `make serve` runs with a server of its own and compose's worker with --attach."""
    assert shlex.split(SERVICES["worker"]["command"]) == ["python", "-m", "flows.serve", "--attach"]
    assert "--attach" in subprocess.run([sys.executable, "-m", "flows.serve", "--help"], cwd=REPO,
                                        capture_output=True, text=True, check=True).stdout


def test_environment_variables_are_read_by_their_programs() -> None:
    import mlflow.environment_variables as mlflow_env
    from mlflow.cli import server
    from prefect.settings import Settings
    from prefect.settings.legacy import _get_valid_setting_names

    from tasks.common.tracking import SERVER_WAIT_ENV

    mlflow_names = {n for n in dir(mlflow_env) if n.startswith("MLFLOW_")}
    mlflow_names |= {p.envvar for p in server.params if isinstance(getattr(p, "envvar", None), str)}
    prefect_names = set(_get_valid_setting_names(Settings))
    ours = {SERVER_WAIT_ENV}
    for name, service in SERVICES.items():
        scripts = " ".join((INFRA / f).read_text() for f in SCRIPTS.get(name, []))
        for var in service.get("environment") or {}:
            named = re.search(rf"\b{var}\b", scripts) or var in (service.get("command") or [])
            read_by_script = {var} if named and name in SCRIPTS else set()
            known = (IMAGE_ENV.get(name, set()) | BOTO_ENV | mlflow_names | prefect_names | ours
                     | read_by_script)
            assert var in known, f"{name}: {var} is read by nothing installed"
            if var.startswith("PREFECT_") and not read_by_script:
                assert var in prefect_names
            if var.startswith("MLFLOW_") and not read_by_script:
                assert var in mlflow_names


def test_no_secret_is_committed_and_every_variable_is_documented() -> None:
    example = dict(line.split("=", 1) for line in (INFRA / "env.example").read_text().splitlines()
                   if line and not line.startswith("#"))
    used = set(re.findall(r"\$\{(\w+)", (INFRA / "compose.yaml").read_text()))
    assert used <= set(example), f"undocumented in env.example: {used - set(example)}"
    for key, value in example.items():
        if "PASSWORD" in key or "SECRET" in key:
            assert value.startswith("change-me"), f"{key} in env.example must be a placeholder"
    # Secrets have no default in compose: it refuses to start without them, and preflight checks
    # each one (every secret of env.example) before any server starts.
    text = (INFRA / "compose.yaml").read_text()
    secret_vars = {k for k in example if "PASSWORD" in k or "SECRET" in k}
    assert set(SERVICES["preflight"]["command"]) == secret_vars
    for var in secret_vars:
        assert f"${{{var}:?" in text, f"{var} has no `:?` guard in compose.yaml"
    for name, service in SERVICES.items():
        if name != "preflight":
            assert service.get("depends_on"), f"{name} may start before preflight"
    # No secret is pasted into a URL (where an `@`, `/` or `%` in it would break or redirect it).
    assert not re.search(r"://[^\s]*\$\{\w*(PASSWORD|SECRET)", text)
    assert {".env", "worker.env"} <= set((INFRA / ".gitignore").read_text().split())
    tracked = subprocess.run(["git", "ls-files", "infra"], cwd=REPO, capture_output=True,
                             text=True).stdout.split()
    assert "infra/.env" not in tracked and "infra/worker.env" not in tracked


def test_pins_match_requirements_lock() -> None:
    mlflow_pin = re.search(r"mlflow\[auth\]==([\d.]+)", (INFRA / "Dockerfile.mlflow").read_text())
    assert mlflow_pin and mlflow_pin.group(1) == _lock_version("mlflow")
    driver_pin = re.search(r"psycopg2-binary==([\d.]+)", (INFRA / "Dockerfile.mlflow").read_text())
    assert driver_pin and driver_pin.group(1) == _lock_version("psycopg2-binary")
    prefect_image = SERVICES["prefect-server"]["image"]
    assert prefect_image.startswith(f"prefecthq/prefect:{_lock_version('prefect')}-python3.11")
    worker = (INFRA / "Dockerfile.worker").read_text()
    assert "-r /tmp/requirements.lock" in worker and "-r /tmp/requirements-torch.lock" in worker
    cuda_torch = re.search(r"torch==([\d.]+)", (INFRA / "Dockerfile.cuda").read_text())
    wanted = re.search(r"^torch==([\d.]+)$", (REPO / "requirements.in").read_text(), re.M)
    assert cuda_torch and wanted and cuda_torch.group(1) == wanted.group(1), "Dockerfile.cuda's torch is not the pin"


@pytest.mark.parametrize("value, refused", [
    (None, "is not set"), ("change-me", "placeholder"), ("change-me-at-least-8-chars", "placeholder"),
    ("tiny-pw", "shorter than 12"), ("a/long@secret%:value", None)])
def test_preflight_refuses_unset_placeholder_and_short_secrets(value: str | None,
                                                              refused: str | None) -> None:
    env = {"PATH": os.environ["PATH"], "OTHER_PASSWORD": "a-real-secret-1234"}
    if value is not None:
        env["DB_PASSWORD"] = value
    done = subprocess.run(["sh", str(INFRA / "preflight.sh"), "DB_PASSWORD", "OTHER_PASSWORD"],
                          env=env, capture_output=True, text=True)
    if refused is None:
        assert done.returncode == 0 and "the 2 secrets are set" in done.stdout, done.stderr
    else:
        assert done.returncode == 1 and "error: DB_PASSWORD " in done.stderr \
            and refused in done.stderr, done.stderr
        assert "OTHER_PASSWORD" not in done.stderr and (value or "\0") not in done.stderr


def test_each_minio_user_reaches_only_its_own_bucket() -> None:
    import runpy

    access = runpy.run_path(str(INFRA / "minio_access.py"))
    users = access["services"]({"MLFLOW_BUCKET": "mlflow", "DVC_BUCKET": "dvc"})
    assert users == {"mlflow": ("mlflow", "MLFLOW_S3_SECRET"), "worker": ("dvc", "WORKER_S3_SECRET")}
    for bucket in ("mlflow", "dvc"):
        resources = {r for statement in access["bucket_policy"](bucket)["Statement"]
                     for r in statement["Resource"]}
        assert resources == {f"arn:aws:s3:::{bucket}", f"arn:aws:s3:::{bucket}/*"}
    env = SERVICES["worker"]["environment"]
    assert env["AWS_ACCESS_KEY_ID"] == "worker" and "MINIO_ROOT" not in str(env)
    assert SERVICES["mlflow"]["environment"]["AWS_ACCESS_KEY_ID"] == "mlflow"


def _allows(policy: dict, action: str, resource: str, user: str) -> bool:
    """IAM-style evaluation of a policy of Allow statements: `*` matches any characters (`/` too),
    `${aws:username}` is the caller's name."""
    from fnmatch import fnmatchcase

    return any(action in st["Action"] and any(
        fnmatchcase(resource, r.replace("${aws:username}", user)) for r in st["Resource"])
        for st in policy["Statement"] if st["Effect"] == "Allow")


def test_a_laptop_key_reads_adds_objects_and_never_writes_the_run_cache() -> None:
    """infra/README.md, "Who can write where": the `laptop-dvc` policy of the DVC bucket."""
    import runpy

    policy = runpy.run_path(str(INFRA / "minio_access.py"))["laptop_policy"]("dvc", "cache")
    obj, runs = "arn:aws:s3:::dvc/cache/files/md5/86/266e3e", "arn:aws:s3:::dvc/cache/runs/77/7784/f695"
    assert _allows(policy, "s3:ListBucket", "arn:aws:s3:::dvc", "alice")
    assert _allows(policy, "s3:GetObject", runs, "alice") and _allows(policy, "s3:GetObject", obj, "alice")
    assert _allows(policy, "s3:PutObject", obj, "alice")  # its data's `dvc push`; pulls verify it
    assert not _allows(policy, "s3:PutObject", runs, "alice")
    assert not _allows(policy, "s3:DeleteObject", obj, "alice")
    assert not _allows(policy, "s3:PutObject", "arn:aws:s3:::mlflow/1/model.safetensors", "alice")
    own, other = "arn:aws:s3:::dvc/laptops/alice/x", "arn:aws:s3:::dvc/laptops/bob/x"
    assert _allows(policy, "s3:PutObject", own, "alice") and _allows(policy, "s3:DeleteObject", own, "alice")
    assert not _allows(policy, "s3:PutObject", other, "alice")
    assert not _allows(policy, "s3:DeleteObject", other, "alice")


def test_the_permissions_table_names_tests_that_exist() -> None:
    """infra/README.md, "Users and permissions": each role says what it can do, what it cannot, and
    the tests that show it; every test named is defined in a test file its row names."""
    section = (INFRA / "README.md").read_text().split("## Users and permissions", 1)[1]
    table = [line for line in section.strip().split("\n\n", 1)[0].splitlines() if line.startswith("|")]
    cells = [[cell.strip() for cell in line.strip("|").split(" | ")] for line in table]
    assert cells[0] == ["role", "what it can do", "what it cannot", "the test that shows it"]
    assert len(cells) > 3 and all(len(row) == 4 for row in cells[2:]), table
    for role, can, cannot, shown in cells[2:]:
        names = re.findall(r"`(test_\w+)`", shown)
        files = [REPO / f for f in re.findall(r"tests/[\w/]+\.py", shown)]
        assert can and cannot and names and files, role
        defined = "".join(f.read_text() for f in files)
        missing = [n for n in names if f"def {n}(" not in defined]
        assert not missing, f"{role}: no such test in {[str(f.relative_to(REPO)) for f in files]}: {missing}"
