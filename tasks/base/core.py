"""Resolve the base model: built-in tiny model, local diffusers folder, or a pinned hub download."""
from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path
from typing import Any

from tasks.common import families
from tasks.common.errors import UserError

log = logging.getLogger(__name__)

# What a diffusers pipeline needs; skips duplicate .bin/.ckpt weights, fp16 variants and samples.
HUB_ALLOW_PATTERNS = ["*.json", "*.txt", "*.model", "*.safetensors"]
HUB_IGNORE_PATTERNS = ["*.fp16.safetensors", "*non_ema*", "*.ckpt", "*ema-only*", "*.bin", "*.msgpack"]
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
#: What to do when base.model is no diffusers pipeline folder.
_SAVE_PRETRAINED = "point base.model at a folder saved with DiffusionPipeline.save_pretrained()"


def classify(model: str) -> str:
    """'builtin', 'local' or 'hub'."""
    if model.startswith("builtin:"):
        if model not in families.BUILTINS:
            raise UserError(
                f"base.model: unknown built-in model {model!r}; choose one of {', '.join(families.BUILTINS)}"
            )
        return "builtin"
    if Path(model).expanduser().exists() or model.startswith((".", "/", "~")):
        return "local"
    if re.fullmatch(r"[\w.-]+/[\w.-]+", model):
        return "hub"
    raise UserError(
        f"base.model: {model!r} is neither a built-in model, an existing local folder nor a hub id "
        "of the form org/name"
    )


def download(repo_id: str, revision: str | None, dst: Path) -> None:
    """Download a pinned hub snapshot (diffusers layout, safetensors only) into dst."""
    if not revision:
        raise UserError(
            f"base.revision must pin a commit of {repo_id} (a 40-character hash from the model page's "
            "'Files and versions' history) so the run is reproducible"
        )
    if not _COMMIT.match(revision):
        log.warning("base.revision %r is not a commit hash: a branch or tag can move", revision)
    import httpx
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled

    try:
        snapshot_download(
            repo_id,
            revision=revision,
            local_dir=dst,
            allow_patterns=HUB_ALLOW_PATTERNS,
            ignore_patterns=HUB_IGNORE_PATTERNS,
        )
    except GatedRepoError as err:
        raise UserError(
            f"{repo_id} is gated: accept its license on https://huggingface.co/{repo_id} with your account, then "
            "give the download a token (export HF_TOKEN=hf_... , or run `hf auth login` once) and run again"
        ) from err
    except (OfflineModeIsEnabled, LocalEntryNotFoundError, OSError, HfHubHTTPError, httpx.TransportError) as err:
        raise UserError(
            f"could not download {repo_id}@{revision} from the Hugging Face Hub ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}). This machine looks offline or the id/revision "
            "is wrong. Download it where there is network (hf download "
            f"{repo_id} --revision {revision} --local-dir DIR), copy DIR here and set base.model: DIR"
        ) from err


def resolve(model: str, revision: str | None, seed: int, dst: Path) -> dict[str, Any]:
    """Write the base pipeline to dst (an empty folder the caller made: atomic_dir's staging); return what
    was resolved."""
    kind = classify(model)
    if kind == "builtin":
        log.info("building %s from seed %d", model, seed)
        families.build_tiny_pipeline(model, seed, dst)
    elif kind == "local":
        src = Path(model).expanduser()
        if not src.is_dir():
            raise UserError(f"base.model: local folder {src} does not exist")
        families.from_index(families.read_index(src, _SAVE_PRETRAINED), f"base.model {src}")  # refused before copying
        log.info("copying local pipeline %s", src)
        shutil.copytree(src, dst, dirs_exist_ok=True)
    else:
        log.info("downloading %s@%s", model, revision)
        download(model, revision, dst)
        shutil.rmtree(dst / ".cache", ignore_errors=True)  # huggingface_hub's download records, in our fresh dst
    index = families.read_index(dst, _SAVE_PRETRAINED)
    family = families.from_index(index, f"base.model {model}")
    family.pipeline.prepare(dst)
    return {"source": kind, "model": model, "revision": revision, "family": family.name,
            "pipeline_class": index.get("_class_name")}
