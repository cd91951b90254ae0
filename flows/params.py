"""What the flow reads from the repository: the stage order (dvc.yaml) and parameter overrides.

- Stage order comes from dvc.yaml itself, so the flow never re-describes the DAG: DVC owns it.
- Overrides are dotted params.yaml keys (`{"train.max_train_steps": 5}`), written into params.yaml
  in place with ruamel.yaml so comments and layout survive, the way `dvc exp run --set-param`
  does it. DVC then sees the changed parameter and reruns exactly the stages that read it.
  Every key must already exist: a misspelt key is an error before anything runs, instead of a
  new, silently ignored entry. Every section an override touches is validated with its stage's
  strict config before the file is written, so a bad value fails at once and params.yaml stays
  as it was (instead of failing later, in the stage, with the bad value left in params.yaml).
"""
from __future__ import annotations

import io
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from tasks.common.errors import UserError


def stage_names(dvc_yaml: Path) -> list[str]:
    """Stage names in the order dvc.yaml lists them (the pipeline's order by contract)."""
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
    return list(stages)


def _load_round_trip(text: str) -> tuple[Any, Any]:
    """Load with ruamel's round-trip mode, set to write back in params.yaml's own style."""
    from ruamel.yaml import YAML

    rt = YAML(typ="rt")  # round-trip: keeps comments, key order, quoting and flow style
    rt.preserve_quotes = True
    rt.width = 4096  # never re-wrap long lines
    rt.indent(mapping=2, sequence=4, offset=2)  # params.yaml's layout: "  key:" / "    - item"
    # ruamel writes a null value as nothing ("key:"); keep the explicit `null` people wrote.
    rt.representer.add_representer(
        type(None), lambda rep, _: rep.represent_scalar("tag:yaml.org,2002:null", "null")
    )
    return rt, rt.load(text)


def _check_override(doc: Mapping[str, Any], dotted: str, value: Any, source: str) -> None:
    node: Any = doc
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        if not isinstance(node, Mapping) or part not in node:
            parent = ".".join(parts[:i])
            where = f"section '{parent}'" if parent else "the top level"
            near = node if isinstance(node, Mapping) else {}
            known = ", ".join(str(k) for k in near) or "(none)"
            raise UserError(
                f"override '{dotted}': {source} has no key '{part}' in {where} (misspelt?). "
                f"Known keys there: {known}"
            )
        node = node[part]
    if isinstance(node, Mapping) or isinstance(value, Mapping):
        raise UserError(
            f"override '{dotted}': override single values, one dotted key each "
            f"(e.g. '{dotted}.<key>'), not whole sections"
        )


def _set(doc: Any, dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    node = doc
    for part in parents:
        node = node[part]
    node[last] = value


def _stage_configs() -> dict[str, type]:
    """The strict config of each params.yaml section (the stages read theirs with load_config)."""
    from tasks.base.config import BaseConfig
    from tasks.class_images.config import ClassImagesConfig
    from tasks.evaluate.config import EvaluateConfig
    from tasks.export.config import ExportConfig
    from tasks.ingest.config import IngestConfig
    from tasks.register.config import RegisterConfig
    from tasks.train.config import TrainConfig

    return {"base": BaseConfig, "ingest": IngestConfig, "class_images": ClassImagesConfig, "train": TrainConfig,
            "export": ExportConfig, "evaluate": EvaluateConfig, "register": RegisterConfig}


def _validate_sections(text: str, sections: set[str], source: str) -> None:
    from tasks.common.config import parse_section

    data = yaml.safe_load(text) or {}
    configs = _stage_configs()
    for section in sorted(sections & set(configs)):
        parse_section(section, data.get(section), configs[section], f"{source} with the overrides")


def apply_overrides(params_path: Path, overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """Write `overrides` into params.yaml in place; return them as applied (possibly empty).

    All keys are checked before the file is touched, and the file is replaced atomically, so a
    bad override leaves params.yaml exactly as it was.
    """
    from tasks.common.outputs import atomic_file

    if not overrides:
        return {}
    params_path = Path(params_path)
    if not params_path.is_file():
        raise UserError(f"{params_path} not found: run the flow from the repository root")
    rt, doc = _load_round_trip(params_path.read_text())
    if not isinstance(doc, Mapping):
        raise UserError(f"{params_path} must be a mapping with one section per stage")
    applied: dict[str, Any] = {}
    for dotted, value in overrides.items():
        if not isinstance(dotted, str) or not dotted or any(not p for p in dotted.split(".")):
            raise UserError(
                f"override key {dotted!r} must be a dotted params.yaml key, e.g. 'train.seed'"
            )
        _check_override(doc, dotted, value, params_path.name)
        applied[dotted] = value
    for dotted, value in applied.items():
        _set(doc, dotted, value)
    buf = io.StringIO()
    rt.dump(doc, buf)
    _validate_sections(buf.getvalue(), {k.split(".")[0] for k in applied}, params_path.name)
    with atomic_file(params_path) as tmp:
        tmp.write_text(buf.getvalue())
    return applied
