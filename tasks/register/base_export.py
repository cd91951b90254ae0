"""Registering an `export.adapters: runtime` fine-tune: its adapter, and its base export once.

The fine-tune's version holds the LoRA only (the diffusers file and GenAI's form, `adapter/`), no
base and no OpenVINO model of its own; its tags (and `adapter/base_export.json`) point at the base
export's version, which holds both: a version of `<model>-base`, registered by the first fine-tune of that base (same
`base_export.key`: the base's fingerprint and the converting libraries) and reused by every later
one. That version's pyfunc serves the base with any registered adapter of it, named per request
(`adapter` param; finetune_runtime/genai_serving.py).
"""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

from finetune_runtime.genai_serving import ADAPTER_ARTIFACT, BASE_INFO, BASE_REF
from tasks.common.genai import ADAPTER_FILE, BASE_DIR
from tasks.common.outputs import link_tree

log = logging.getLogger(__name__)

BASE_SUFFIX = "-base"


def stage_adapter(openvino: Path, work: Path, tags: dict[str, str]) -> Path:
    """The runtime export without its base (the adapter files) and BASE_REF (the base export's
    registered version, from `tags`), as a folder under `work`."""
    out = work / ADAPTER_ARTIFACT
    out.mkdir(parents=True)
    for item in Path(openvino).iterdir():
        if item.name != BASE_DIR and item.is_file():
            shutil.copy2(item, out / item.name)
    ref = {"model": tags["base_export.model"], "version": tags["base_export.version"]}
    (out / BASE_REF).write_text(json.dumps(ref, indent=2) + "\n")
    return out


def stage_base(openvino: Path, work: Path, guidance_scale: float) -> tuple[Path, dict[str, Any]]:
    """The runtime export's base/ with BASE_INFO (key, family, the shape the endpoint compiles at)."""
    adapter = json.loads((Path(openvino) / ADAPTER_FILE).read_text())
    info = {"key": adapter["base_key"], "base_fingerprint": adapter["base_fingerprint"],
            "family": adapter["family"], "guidance_scale": guidance_scale,
            "static_shape": {**adapter["static_shape"], "num_images_per_prompt": 1, "batch_size": 1}}
    out = work / "base-export"
    link_tree(Path(openvino) / BASE_DIR, out)
    (out / BASE_INFO).write_text(json.dumps(info, indent=2) + "\n")
    return out, info


def runtime_export_of(adapter_dir: Path, dst: Path) -> tuple[Path, Path]:
    """(runtime export folder, base pipeline folder) of a registered run-time adapter version, from
    its `adapter/` artifact and its base export's registered version (downloaded): the export stage's
    layout (base/ + the adapter files), built at `dst` by hard links, what the evaluate stage reads."""
    from finetune_runtime.genai_serving import base_export_of

    export, pipeline, _ = base_export_of(str(adapter_dir))
    dst = Path(dst)
    dst.mkdir(parents=True)
    for item in Path(adapter_dir).iterdir():
        if item.is_file() and item.name != BASE_REF:
            shutil.copy2(item, dst / item.name)
    link_tree(export, dst / BASE_DIR)
    return dst, Path(pipeline)


def find_base_version(client: Any, base_name: str, key: str) -> str | None:
    """The version of `base_name` registered for base export `key`, if any (the newest)."""
    from mlflow.exceptions import MlflowException

    try:
        versions = client.search_model_versions(f"name='{base_name}'")
    except MlflowException:
        return None
    found = [int(v.version) for v in versions if v.tags.get("base_export.key") == key]
    return str(max(found)) if found else None
