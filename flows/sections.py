"""The params.yaml sections and the typed config that reads each, and the stage order dvc.yaml gives:
what flows/params.py (overrides) and flows/params_doc.py (docs/parameters.md) both read."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tasks.common.config import StageConfig
from tasks.common.errors import UserError

#: The typed config of each params.yaml section ("module:Class"): an override is validated with
#: the same class the stage loads it with. Sections not listed here (a project of one's own) are
#: only checked for existing keys. tests/flows/test_params.py keeps this table in step with
#: params.yaml.
SECTION_CONFIGS = {
    "base": "tasks.base.config:BaseConfig",
    "ingest": "tasks.ingest.config:IngestConfig",
    "class_images": "tasks.class_images.config:ClassImagesConfig",
    "train": "tasks.train.config:TrainConfig",
    "export": "tasks.export.config:ExportConfig",
    "evaluate": "tasks.evaluate.config:EvaluateConfig",
    "register": "tasks.register.config:RegisterConfig",
}


def stage_names(dvc_yaml: Path) -> list[str]:
    """Stage names in the order dvc.yaml lists them (the pipeline's order by contract)."""
    return list(dvc_stages(dvc_yaml))


def dvc_stages(dvc_yaml: Path) -> dict[str, Any]:
    """dvc.yaml's `stages`; a UserError naming the file when it is missing, unreadable or empty."""
    dvc_yaml = Path(dvc_yaml)
    if not dvc_yaml.is_file():
        raise UserError(f"{dvc_yaml} not found: run the flow from the repository root")
    try:
        data = yaml.safe_load(dvc_yaml.read_text()) or {}
    except yaml.YAMLError as err:
        raise UserError(f"{dvc_yaml} is not valid YAML: {err}") from err
    stages = data.get("stages") if isinstance(data, dict) else None
    if not isinstance(stages, dict) or not stages:
        raise UserError(f"{dvc_yaml} has no 'stages' mapping: nothing to run")
    return stages


def section_config(section: str) -> type[StageConfig] | None:
    """The stage config class that reads `section`, or None for a section not in the table."""
    import importlib

    target = SECTION_CONFIGS.get(section)
    if target is None:
        return None
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)
