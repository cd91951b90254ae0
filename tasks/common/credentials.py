"""Which credentials each stage's process may hold, and the redaction of secret-looking values.

Credentials reach the pipeline through the environment only (infra/README.md, "Who gets which
secret"). A stage gets the ones it uses and nothing else: `STAGE_CREDENTIALS` is the table. Every
other variable whose name looks secret (`looks_secret`), and MLflow's user name, is removed from
the stage's environment before the stage does any work:

- `tasks.common.confine.confine(stage)`, the first call of every stage's `main()`: when the process holds a credential
  the table does not give the stage, it replaces itself (`execve`) with the same command under the
  stripped environment, so `/proc/<pid>/environ` of the stage, and of every rank or process it
  starts, never shows it. DVC starts a stage's command with DVC's own environment (and `dvc repro
  --pull` needs the DVC remote's keys), so the stage's own entry is where stripping can happen for
  both `dvc repro` and the flow.
- a stage given no MLflow credentials that logs to an http(s) tracking server (ingest,
  class_images on the team stack) runs as a child under the stripped environment, logging to a
  local store; this process, which holds the credentials but parses nothing, copies the run to
  the server (`tasks.common.confine`).
- the flow (flows/dvc_stage.py) passes `dvc` itself the `"dvc"` row: what its stages may get plus
  the DVC remote's keys, never Prefect's auth string.
"""
from __future__ import annotations

import os
import re
from collections.abc import Mapping

from tasks.common.errors import UserError

#: a name part (between underscores) that marks a secret: HF_TOKEN, PREFECT_API_AUTH_STRING, AWS_ACCESS_KEY_ID
SECRET_PARTS = frozenset({"TOKEN", "KEY", "AUTH", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "CREDENTIALS"})
#: words that mark a secret anywhere in the name: PGPASSWORD, MINIO_ROOT_PASSWORD, GOOGLE_APPLICATION_CREDENTIALS
SECRET_WORDS = ("PASSWORD", "SECRET", "CREDENTIAL")
#: not secret-looking by name, but half of a credential pair
CREDENTIAL_NAMES = frozenset({"MLFLOW_TRACKING_USERNAME"})

MLFLOW = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")
HUB = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
DVC_REMOTE = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")

#: stage -> the credential variables its process may hold. Everything else secret-looking is removed.
STAGE_CREDENTIALS: dict[str, tuple[str, ...]] = {
    "base": (*MLFLOW, *HUB),     # logs its run; downloads the base model (gated ones need the token)
    "data_manifest": (),         # lists the data folder (tasks/ingest/manifest.py); logs no run, so nothing to relay
    "ingest": (),                # parses untrusted files: its run is relayed (tasks.common.confine)
    "class_images": (),          # its run is relayed, as ingest's
    "train": MLFLOW,             # rank 0 logs the run; every rank gets the same environment
    "export": MLFLOW,
    "evaluate": MLFLOW,
    "dvc": (*MLFLOW, *HUB, *DVC_REMOTE),  # `dvc repro`/`pull`/`push` as the flow runs them
}

#: stages that log no MLflow run: confined by re-executing with their row only, never relayed
LOGS_NO_RUN = frozenset({"data_manifest"})

REDACTED = "***"


def looks_secret(name: str) -> bool:
    """True for a variable name that holds a secret by its look: HF_TOKEN, AWS_SECRET_ACCESS_KEY,
    PREFECT_API_AUTH_STRING, PGPASSWORD (not TOKENIZERS_PARALLELISM: whole parts only)."""
    upper = name.upper()
    return bool(SECRET_PARTS & set(re.split(r"[^A-Z0-9]+", upper))) or any(w in upper for w in SECRET_WORDS)


def is_credential(name: str) -> bool:
    return looks_secret(name) or name.upper() in CREDENTIAL_NAMES


def allowed(stage: str) -> tuple[str, ...]:
    try:
        return STAGE_CREDENTIALS[stage]
    except KeyError:
        raise UserError(f"no credential row for stage '{stage}' in tasks/common/credentials.py "
                        f"STAGE_CREDENTIALS (rows: {', '.join(STAGE_CREDENTIALS)}): add one naming "
                        "the variables it reads, () for none") from None


def stage_environ(stage: str, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """`env` (default: ours) without the credentials `stage` is not given."""
    keep = set(allowed(stage))
    env = os.environ if env is None else env
    return {k: v for k, v in env.items() if k in keep or not is_credential(k)}


def redact(env: Mapping[str, str]) -> dict[str, str]:
    """`env` with the value of every secret-looking name shown as ***, for logs and params."""
    return {k: REDACTED if looks_secret(k) else v for k, v in env.items()}


def redact_nested(params: Mapping[str, object], parent: str = "") -> dict[str, object]:
    """`redact_params` for nested params (dvc.lock's, a lineage document's): the secret-looking
    entries of every `env` mapping shown as ***."""
    return {key: (REDACTED if parent == "env" and looks_secret(str(key))
                  else redact_nested(value, str(key)) if isinstance(value, Mapping) else value)
            for key, value in params.items()}


def redact_params(flat: Mapping[str, object]) -> dict[str, object]:
    """Flattened params (`train.launch.env.HF_TOKEN`) with an environment mapping's secret-looking
    entries shown as ***; every other value as it is (`train.placeholder_token` stays)."""
    out: dict[str, object] = {}
    for key, value in flat.items():
        parts = key.split(".")
        secret = len(parts) >= 2 and parts[-2] == "env" and looks_secret(parts[-1])
        out[key] = REDACTED if secret else value
    return out
