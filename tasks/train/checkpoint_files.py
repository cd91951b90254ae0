"""What a checkpoint folder may hold, how its own states are stored, and how it is verified.

A resume must never run code from the folder it reads. Three guards, in this order:

1. `manifest.json`, written last into each checkpoint by this stage: the run key and the sha256 of
   every file. A folder without it, of another run key, with a file that is not listed, missing or
   changed, or with a file name outside `ALLOWED`, is refused before anything in it is read.
2. Our own states (the loop position, the EMA weights) are written as safetensors + JSON
   (`save_state_dict`), never pickled, so nothing of ours needs an unpickler.
3. accelerate's optimizer, scheduler and RNG files are pickles by design; accelerate reads them
   with `torch.load(weights_only=True)`, PyTorch's restricted unpickler, which builds tensors and
   plain containers only and refuses any other global (so a forged manifest does not make a
   crafted pickle run either). Weights go through safetensors (`checkpoints.register_weight_hooks`).
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from tasks.common.errors import UserError
from tasks.common.fingerprint import sha256_file

MANIFEST = "manifest.json"
FORMAT = 1
# Every file a checkpoint of this stage holds: ours (safetensors + JSON) and accelerate's states.
ALLOWED = re.compile(
    r"(trainable_\w+\.safetensors|state_\w+\.(safetensors|json)"
    r"|(optimizer|scheduler|sampler|dl_state_dict)(_\d+)?\.bin|random_states_\d+\.pkl|scaler\.pt)"
)
_TENSOR = "__tensor__"


def save_state_dict(state: dict[str, Any], folder: Path, name: str) -> None:
    """`state` (nested dicts/lists of numbers, strings and tensors) as state_<name>.safetensors + .json."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}

    def strip(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            key = f"t{len(tensors)}"
            tensors[key] = value.detach().cpu().contiguous()
            return {_TENSOR: key}
        if isinstance(value, dict):
            return {str(k): strip(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [strip(v) for v in value]
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        raise TypeError(f"cannot store a {type(value).__name__} in a checkpoint state")

    skeleton = strip(state)
    save_file(tensors, str(folder / f"state_{name}.safetensors"))
    (folder / f"state_{name}.json").write_text(json.dumps(skeleton))


def load_state_dict(folder: Path, name: str) -> dict[str, Any]:
    """The state `save_state_dict` wrote, tensors on the CPU."""
    from safetensors.torch import load_file

    tensors = load_file(str(folder / f"state_{name}.safetensors"))

    def fill(value: Any) -> Any:
        if isinstance(value, dict):
            if set(value) == {_TENSOR}:
                return tensors[value[_TENSOR]]
            return {k: fill(v) for k, v in value.items()}
        if isinstance(value, list):
            return [fill(v) for v in value]
        return value

    return fill(json.loads((folder / f"state_{name}.json").read_text()))


def write_manifest(folder: Path, run_key: str, step: int) -> None:
    """Hash every file of a finished checkpoint (call once all processes have written theirs)."""
    files = {p.name: sha256_file(p) for p in sorted(folder.iterdir()) if p.name != MANIFEST}
    manifest = {"format": FORMAT, "run_key": run_key, "step": step, "files": files}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


FIX = "resume only from this run's own checkpoints (train.resume: latest), or start over (train.resume: none)"


def check(folder: Path, run_key: str, hashes: bool = True) -> tuple[str, str] | None:
    """Why `folder` is not a checkpoint this stage wrote for run `run_key`, unchanged since: (a short
    reason for a log line, the whole explanation), or None when it verifies. Reads only the manifest,
    the folder's listing and (`hashes`) the files' bytes."""
    file = folder / MANIFEST
    try:
        manifest = json.loads(file.read_text())
        files, key = dict(manifest["files"]), str(manifest["run_key"])
        if manifest["format"] != FORMAT or manifest["step"] != int(folder.name.rsplit("-", 1)[-1]):
            raise ValueError("format or step does not match")
    except FileNotFoundError:
        return (f"no {MANIFEST}", f"{folder} has no {MANIFEST}: it was not written by this stage's "
                "checkpointing, so it is not trusted")
    except (ValueError, KeyError, TypeError) as err:
        return f"{MANIFEST} is not valid ({err})", f"{file} is not a valid checkpoint manifest ({err})"
    if key != run_key:
        return (f"of run {key}, not this run", f"{folder} belongs to run {key}, not to this run {run_key} "
                "(other settings, base model or data)")
    present = {p.name for p in folder.iterdir() if p.name != MANIFEST}
    problems = [f"{n}: not a checkpoint file" for n in sorted(present) if not ALLOWED.fullmatch(n)]
    problems += [f"{n}: not in the manifest" for n in sorted(present - set(files))]
    problems += [f"{n}: missing" for n in sorted(set(files) - present)]
    problems += [f"{n}: changed since it was written (hash mismatch)" for n in sorted(present & set(files))
                 if hashes and sha256_file(folder / n) != files[n]]
    if problems:
        return "; ".join(problems), f"{folder} was altered after this stage wrote it ({'; '.join(problems)})"
    return None


def verify(folder: Path, run_key: str, hashes: bool = True) -> None:
    """Refuse `folder` unless this stage wrote it for run `run_key` and nothing changed since.

    `hashes=False` checks all but the file contents (hashing a large checkpoint takes seconds)."""
    if why := check(folder, run_key, hashes):
        raise UserError(f"{why[1]}. Nothing in it was read; {FIX}")
