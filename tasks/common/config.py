"""Typed, strict loading of one params.yaml section per stage.

Each stage declares a pydantic model (`StageConfig` subclass) for its own section. Unknown keys,
wrong types and out-of-range values fail at load time with the key's dotted path, one line each, e.g.
`params.yaml: invalid parameters: train.learning_rate: Input should be greater than 0 (got -1)`.
A misspelt key gets the closest known key (`train.learning_rat: unknown key (misspelt?). Did you
mean 'train.learning_rate'?`); the section's whole key list is in docs/parameters.md, named in the
message, not pasted into it.
"""
from __future__ import annotations

import difflib
import types
import typing
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


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The one pydantic model a field's annotation holds: the model itself, or inside `X | None`,
    `list[X]`, `tuple[X, ...]`, `Annotated[X, ...]`; None for anything else (two models: a union)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return _model_in(args[0])
    if origin in (typing.Union, types.UnionType, list, tuple, set, frozenset):
        models = {m for arg in args if arg is not type(None) and arg is not Ellipsis
                  and (m := _model_in(arg)) is not None}
        return models.pop() if len(models) == 1 else None
    return None


def _fields_at(model: type[BaseModel], loc: tuple) -> list[str]:
    """Field names of the (nested) model found by following `loc` from `model`; a list index
    (`train.concepts.0`) stays on the list's item model. [] where `loc` leads to no one model."""
    current: type[BaseModel] = model
    for part in loc:
        if isinstance(part, int):
            continue
        field = current.model_fields.get(part)
        found = _model_in(field.annotation) if field is not None else None
        if found is None:
            return []
        current = found
    return list(current.model_fields)


#: Where every key of every section is listed with its type, default and allowed values.
KEYS_DOC = "docs/parameters.md"


def _unknown_key(section: str, loc: tuple, model: type[BaseModel]) -> str:
    """One line for a key the config does not define: the closest known key, and where all are."""
    key = ".".join([section, *(str(p) for p in loc)])
    parent = ".".join([section, *(str(p) for p in loc[:-1])])
    known = _fields_at(model, loc[:-1])
    by_lower = {name.lower(): name for name in known}
    guess = difflib.get_close_matches(str(loc[-1]).lower(), list(by_lower), n=1, cutoff=0.6)
    hint = f"Did you mean '{parent}.{by_lower[guess[0]]}'?" if guess else f"'{parent}' has no key like it."
    return f"{key}: unknown key (misspelt?). {hint} Every key of '{parent}': {KEYS_DOC}"


def parse_section(section: str, data: Any, model: type[C], source: str = "params.yaml") -> C:
    """Validate `data` as `model`, turning pydantic errors into one message with dotted key paths."""
    if data is None:
        raise UserError(f"{source}: section '{section}' is missing; add it (see docs/parameters.md)")
    try:
        return model.model_validate(data)
    except ValidationError as err:
        lines = []
        for e in err.errors():
            if e["type"] == "extra_forbidden":
                lines.append(_unknown_key(section, tuple(e["loc"]), model))
            else:
                key = ".".join([section, *(str(p) for p in e["loc"])])
                lines.append(f"{key}: {e['msg']} (got {e.get('input')!r})")
        if len(lines) == 1:  # the usual case, a single typo: one line
            raise UserError(f"{source}: invalid parameters: {lines[0]}") from None
        raise UserError(f"{source}: invalid parameters:\n  " + "\n  ".join(lines)) from None


def load_config(section: str, model: type[C], params_path: Path = DEFAULT_PARAMS) -> C:
    """Load and validate one section of params.yaml."""
    return parse_section(section, read_params(params_path).get(section), model, str(params_path))
