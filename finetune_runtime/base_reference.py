"""A version whose base is registered by reference: what the base is and where it was, not a copy.

An adapters-only fine-tune (`train.fuse_lora: false`) is registered with the base its adapters
apply to. A base larger than `register.base_copy_max_gb` (a 15 GB FLUX.2 [klein], a 33 GB FLUX.1-dev)
is not copied into every version's run: the version carries `base_reference/base_reference.json`,
the base's name (`base.model`), its pinned revision, its DVC hash (`dvc pull models/base` at the
version's git commit brings it back), the folder it was registered from and the size of every file.
The version's OpenVINO export serves it without the base; the diffusers backend (and re-scoring)
finds the base with `resolve`.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from finetune_runtime import cpu_formats, layout

log = logging.getLogger("sd_pyfunc")

ARTIFACT = layout.BASE_REFERENCE
FILE = "base_reference.json"
#: A folder holding a copy of the base, used instead of the recorded one (another machine's path)
BASE_DIR_ENV = "FINETUNE_BASE_DIR"


def file_sizes(folder: Path) -> dict[str, int]:
    """{relative posix path: bytes} of every file of a model folder, hidden files left out."""
    folder = Path(folder)
    return {p.relative_to(folder).as_posix(): p.stat().st_size for p in sorted(folder.rglob("*"))
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts)}


def write(base: Path, out: Path, model: str | None, revision: str | None, dvc_md5: str | None) -> dict[str, Any]:
    """Write the reference to `base` into the folder `out` (created); the reference."""
    files = file_sizes(base)
    reference = {"model": model, "revision": revision, "dvc_md5": dvc_md5, "path": str(Path(base).resolve()),
                 "size_bytes": sum(files.values()), "files": files}
    Path(out).mkdir(parents=True)
    (Path(out) / FILE).write_text(json.dumps(reference, indent=2) + "\n")
    return reference


def read(folder: str | Path) -> dict[str, Any]:
    return json.loads((Path(folder) / FILE).read_text())


def _matches(folder: Path, files: dict[str, int]) -> str | None:
    """Why `folder` is not the referenced base (a file missing or of another size), or None."""
    if not layout.is_pipeline(folder):
        return f"{folder} holds no pipeline (model_index.json)"
    for rel, size in files.items():
        path = folder / rel
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size != size:
            return f"{path} has {path.stat().st_size} bytes, the registered base's has {size}"
    return None


def local_folder(folder: str | Path) -> str | None:
    """The referenced base's folder on this machine ($FINETUNE_BASE_DIR, else the recorded path), or None."""
    reference = read(folder)
    override = os.environ.get(BASE_DIR_ENV)
    if override:
        why = _matches(Path(override), reference["files"])
        if why:
            raise ValueError(f"{BASE_DIR_ENV}={override} is not this version's base: {why}")
        return override
    recorded = Path(reference["path"])
    return str(recorded) if recorded.is_dir() and _matches(recorded, reference["files"]) is None else None


def resolve(folder: str | Path) -> tuple[str, dict[str, Any]]:
    """(what to pass to `DiffusionPipeline.from_pretrained`, its keyword arguments) for the referenced
    base: a local copy when there is one, else the hub id at its pinned revision; an error naming the
    base and the ways to provide it when neither is there."""
    found = local_folder(folder)
    if found:
        return found, {}
    reference = read(folder)
    model, revision = reference.get("model"), reference.get("revision")
    if model and revision and not str(model).startswith("builtin:"):  # a hub id
        return str(model), {"revision": revision}
    raise ValueError(
        f"this version's base ({model}, {reference['size_bytes'] / 2 ** 30:.1f} GB, "
        f"DVC md5 {reference.get('dvc_md5')}) "
        f"was registered by reference and is not at {reference['path']}: set {BASE_DIR_ENV} to a copy of it "
        "(`dvc pull models/base` at the version's git_commit tag), or serve the version's OpenVINO export "
        "(FINETUNE_PYFUNC_BACKEND=openvino)")


#: The train stage's base precisions the diffusers backend loads a referenced base in (torchao's
#: weight-only configs, applied by diffusers and transformers as each model loads); others: stored dtype
TORCHAO_CONFIGS = {"int8": "Int8WeightOnlyConfig", "fp8": "Float8WeightOnlyConfig"}


def quantization(precision: dict[str, str] | None) -> dict[str, Any]:
    """from_pretrained's `quantization_config` for a referenced base: each named model in the precision
    the fine-tune trained on (model_config `base_precision`, {component: precision}, written at
    registration from the train report), quantized as it loads by diffusers' or transformers'
    torchao config, in bf16 where the CPU computes it natively, else fp32 (cpu_formats.py); so the
    base of a 12B FLUX.1-dev serves in the memory it trained in, as evaluate scored it. Precisions
    other than TORCHAO_CONFIGS' load in the stored dtype."""
    import diffusers
    import torch
    import torchao.quantization
    import transformers

    mapping = {}
    for name, value in (precision or {}).items():
        key = value.split("-")[0]
        if key in TORCHAO_CONFIGS:
            library = transformers if name.startswith("text_encoder") else diffusers
            mapping[name] = library.TorchAoConfig(getattr(torchao.quantization, TORCHAO_CONFIGS[key])())
    if not mapping:
        return {}
    # the whole pipeline in one dtype (an fp32 base's other parts would not take the denoiser's bf16
    # activations): bf16, what big bases are released in, where this CPU computes it natively; fp32
    # where it would emulate it (AVX2 only: ~500x slower; torchao's weight-only layers take fp32 too)
    choice = cpu_formats.auto_bf16()
    log.info("the referenced base, quantized as it loads: %s", choice.line())
    return {"quantization_config": diffusers.PipelineQuantizationConfig(quant_mapping=mapping),
            "torch_dtype": torch.bfloat16 if choice.precision == "bf16" else torch.float32}
