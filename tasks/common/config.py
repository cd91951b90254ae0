"""Typed, strict loading of one params.yaml section per stage.

Each stage declares a pydantic model (`StageConfig` subclass) for its own section. Unknown keys,
wrong types and out-of-range values fail at load time with the key's dotted path, e.g.
`params.yaml: train.learning_rate: Input should be greater than 0 (got -1)`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from tasks.common.errors import UserError

DEFAULT_PARAMS = Path("params.yaml")


class StageConfig(BaseModel):
    """Base for stage configs: frozen, and unknown keys are an error (catches misspelt params)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


C = TypeVar("C", bound=StageConfig)


def read_params(path: Path = DEFAULT_PARAMS) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path} not found: run from the repository root or pass --params PATH")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise UserError(f"{path} is not valid YAML: {err}") from err
    if not isinstance(data, dict):
        raise UserError(f"{path} must be a mapping with one section per stage")
    return data


def _fields_at(model: type[BaseModel], loc: tuple) -> list[str]:
    """Field names of the (nested) model found by following `loc` from `model`."""
    current: Any = model
    for part in loc:
        field = current.model_fields.get(part) if isinstance(part, str) else None
        annotation = getattr(field, "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        current = annotation
    return list(current.model_fields)


def parse_section(section: str, data: Any, model: type[C], source: str = "params.yaml") -> C:
    """Validate `data` as `model`, turning pydantic errors into one message with dotted key paths."""
    if data is None:
        raise UserError(f"{source}: section '{section}' is missing; add it (see docs/parameters.md)")
    try:
        return model.model_validate(data)
    except ValidationError as err:
        lines = []
        for e in err.errors():
            key = ".".join([section, *(str(p) for p in e["loc"])])
            if e["type"] == "extra_forbidden":
                parent = ".".join([section, *(str(p) for p in e["loc"][:-1])])
                allowed = ", ".join(sorted(_fields_at(model, e["loc"][:-1])))
                lines.append(f"{key}: unknown key (misspelt?). Known keys of '{parent}': {allowed}")
            else:
                lines.append(f"{key}: {e['msg']} (got {e.get('input')!r})")
        raise UserError(f"{source}: invalid parameters:\n  " + "\n  ".join(lines)) from None


def load_config(section: str, model: type[C], params_path: Path = DEFAULT_PARAMS) -> C:
    """Load and validate one section of params.yaml."""
    return parse_section(section, read_params(params_path).get(section), model, str(params_path))
