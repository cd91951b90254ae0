"""What the flow reads from the repository: the stage order and output paths (dvc.yaml), and
parameter overrides.

- Stage order comes from dvc.yaml itself, so the flow never re-describes the DAG: DVC owns it.
- Output paths too: `stage_output` reads the path a stage's command is given for an output
  (`--out`, `--report`), so a path is written in dvc.yaml only.
- Overrides are dotted params.yaml keys (`{"train.max_train_steps": 5}`). `validate_overrides`
  checks them against the stage configs (every key must be in params.yaml or defined by its
  section's typed config, i.e. listed in docs/parameters.md, and the section it changes must
  still validate as that stage's typed config) before anything runs, without writing anything.
  `apply_overrides` then writes them into the params.yaml of the experiment's own workspace
  (flows/experiment.py), never into the tracked one, with ruamel.yaml so comments and layout
  survive, the way `dvc exp run --set-param` does it. A key the config defines but params.yaml
  leaves out (`train.lora_type`, its default applies) is added to its section, as DVC's
  `--set-param +train.lora_type=dora` would add it: the stage reads it from its section, and DVC,
  which tracks the whole section (`params: - train`), reruns the stage.
- `check_params` then loads every section (overrides applied) as its stage's typed config and
  refuses the combinations a later stage refuses (flows/combinations.py: `export.adapters: runtime`
  with DoRA, LoKr, LoHa, a full pipeline or a family GenAI cannot take; an edit dataset with prior
  preservation or a base that takes no reference images), naming both keys, before any stage runs.
"""
from __future__ import annotations

import difflib
import io
import shlex
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from flows.sections import SECTION_CONFIGS, dvc_stages, section_config
from tasks.common.config import parse_section, read_params
from tasks.common.errors import UserError
from tasks.ingest.deps import interpolate


def _declared(definition: Mapping[str, Any]) -> set[str]:
    """A stage's outs, metrics and plots (each a path, or {path: options}) as posix paths."""
    entries = [e for kind in ("outs", "metrics", "plots") for e in definition.get(kind) or []]
    return {Path(str(next(iter(e)) if isinstance(e, dict) else e)).as_posix().rstrip("/") for e in entries}


def stage_output(dvc_yaml: Path, stage: str, flag: str) -> Path | None:
    """The output path dvc.yaml's `stage` command is given as `flag` (e.g. train `--out`, evaluate
    `--report`), relative to dvc.yaml's folder, `${key}` filled in from params.yaml beside it.

    None when dvc.yaml has no such stage or its command no such argument (a pipeline of one's
    own); a UserError when the path is not among the stage's outs, metrics or plots."""
    definition = dvc_stages(dvc_yaml).get(stage)
    if not isinstance(definition, Mapping):
        return None
    cmds = definition.get("cmd") or []
    argv = [arg for cmd in ([cmds] if isinstance(cmds, str) else cmds) for arg in shlex.split(str(cmd))]
    values = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == flag]
    values += [arg.partition("=")[2] for arg in argv if arg.startswith(f"{flag}=")]
    if not values:
        return None
    value = values[0]
    if Path(value).as_posix().rstrip("/") not in _declared(definition):
        raise UserError(f"{dvc_yaml}: stage '{stage}' is given {flag} {value}, which is not among its "
                        "outs, metrics or plots, so DVC does not track it: declare it there")
    if "${" in value:
        resolved = interpolate(value, read_params(Path(dvc_yaml).parent / "params.yaml"))
        if resolved is None:
            raise UserError(f"{dvc_yaml}: stage '{stage}' {flag} {value}: a key params.yaml does not have")
        value = resolved
    return Path(value)


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


def config_keys(section: str) -> dict[str, str]:
    """Every dotted key the typed config of `section` defines, as docs/parameters.md lists it
    (flows/params_doc.py walks the same classes), with its kind: 'value', 'group' (a nested model)
    or 'items' (a list of models); {} for a section no stage config reads."""
    return dict(_config_keys(section))


@cache
def _config_keys(section: str) -> tuple[tuple[str, str], ...]:
    from flows.params_doc import tables

    model = section_config(section)
    if model is None:
        return ()
    return tuple((key.path, key.kind) for table in tables(section, model, []) for key in table.keys)


def _known_below(section: str, parent: str, near: Any) -> list[str]:
    """The keys under `parent`: those params.yaml has there, then those the config defines."""
    written = [str(k) for k in near] if isinstance(near, Mapping) else []
    if not parent:
        return list(dict.fromkeys([*written, *SECTION_CONFIGS]))
    prefix = f"{parent}."
    defined = [path[len(prefix):] for path in config_keys(section)
               if path.startswith(prefix) and "." not in path[len(prefix):]]
    return list(dict.fromkeys([*written, *defined]))


def _unknown_key(dotted: str, index: int, near: Any, source: str) -> UserError:
    parts = dotted.split(".")
    parent, part = ".".join(parts[:index]), parts[index]
    where = f"section '{parent}'" if parent else "the top level"
    model = section_config(parts[0]) if parent else None
    nor = f", nor does {model.__name__} define it" if model is not None else ""
    known = _known_below(parts[0], parent, near)
    guess = difflib.get_close_matches(part, known, n=1)
    hint = f"Did you mean '{'.'.join([*parts[:index], guess[0]])}'? " if guess else ""
    return UserError(
        f"override '{dotted}': {source} has no key '{part}' in {where}{nor} (misspelt?). "
        f"{hint}Known keys there: {', '.join(known) or '(none)'}. "
        "Every key, with its type and allowed values: docs/parameters.md"
    )


def _check_override(doc: Mapping[str, Any], dotted: str, value: Any, source: str) -> None:
    """A UserError unless `dotted` is a single value params.yaml has or the section's config
    defines (then it is added: parents that are missing or null become mappings). A mapping is
    a value only where the config types one (`train.launch.env`), not a group of keys."""
    parts = dotted.split(".")
    defined = {**config_keys(parts[0]), **dict.fromkeys(SECTION_CONFIGS, "group")}
    node: Any = doc
    for i, part in enumerate(parts):
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif ".".join(parts[:i + 1]) in defined and (node is None or isinstance(node, Mapping)):
            node = None  # the config defines it; params.yaml leaves it to its default
        else:
            raise _unknown_key(dotted, i, node, source)
    if (isinstance(node, Mapping) or isinstance(value, Mapping)) and defined.get(dotted) != "value":
        raise UserError(
            f"override '{dotted}': override single values, one dotted key each "
            f"(e.g. '{dotted}.<key>'), not whole sections"
        )


def _set(doc: Any, dotted: str, value: Any) -> None:
    """Set `dotted` in `doc`, making the parents params.yaml lacks (or has as null) mappings of
    `doc`'s own type (ruamel's keep their layout)."""
    *parents, last = dotted.split(".")
    node = doc
    for part in parents:
        if not isinstance(node.get(part), Mapping):
            node[part] = type(doc)()
        node = node[part]
    node[last] = value


def _check_keys(doc: Mapping[str, Any], overrides: Mapping[str, Any],
                source: str) -> dict[str, Any]:
    applied: dict[str, Any] = {}
    for dotted, value in overrides.items():
        if not isinstance(dotted, str) or not dotted or any(not p for p in dotted.split(".")):
            raise UserError(
                f"override key {dotted!r} must be a dotted params.yaml key, e.g. 'train.seed'"
            )
        _check_override(doc, dotted, value, source)
        applied[dotted] = value
    return applied


def _read_mapping(params_path: Path) -> tuple[Any, Any]:
    params_path = Path(params_path)
    if not params_path.is_file():
        raise UserError(f"{params_path} not found: run the flow from the repository root")
    rt, doc = _load_round_trip(params_path.read_text())
    if not isinstance(doc, Mapping):
        raise UserError(f"{params_path} must be a mapping with one section per stage")
    return rt, doc


def validate_overrides(params_path: Path, overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """Check `overrides` against params.yaml and the stage configs; write nothing.

    Every key must exist in params.yaml or be defined by its section's typed config (all of
    docs/parameters.md), and each section an override changes must still load as its stage's
    typed config (`train.learning_rate=abc` fails here, naming the key, instead of
    in the train stage an hour later). Returns the overrides as they will be applied.
    """
    if not overrides:
        return {}
    params_path = Path(params_path)
    _, doc = _read_mapping(params_path)
    applied = _check_keys(doc, overrides, params_path.name)
    data = yaml.safe_load(params_path.read_text()) or {}
    for dotted, value in applied.items():
        _set(data, dotted, value)
    for section in dict.fromkeys(k.split(".")[0] for k in applied):
        model = section_config(section)
        if model is not None:
            where = f"{params_path.name} with overrides {_shown(applied, section)}"
            parse_section(section, data.get(section), model, where)
    return applied


def check_params(params_path: Path, applied: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Load every section of params.yaml (with `applied`, overrides validate_overrides returned) that a
    stage config reads, as that config, and refuse the combinations a later stage would refuse
    (flows/combinations.py), naming both keys and the fix; write nothing. The flow calls it before
    any stage runs. Returns the loaded configs by section."""
    from flows import combinations

    params_path = Path(params_path)
    data = read_params(params_path)
    for dotted, value in (applied or {}).items():
        _set(data, dotted, value)
    where = f"{params_path.name} with overrides {_shown(applied, '')}" if applied else params_path.name
    configs = {section: parse_section(section, data[section], model, where)
               for section in SECTION_CONFIGS if section in data and (model := section_config(section))}
    if found := combinations.problems(configs, params_path.parent):
        raise UserError(f"{where}: settings that a later stage refuses (nothing has run):\n  " + "\n  ".join(found))
    return configs


def _shown(applied: Mapping[str, Any], section: str) -> str:
    """The overrides of `section` ('': all) as `key=value, ...`."""
    return ", ".join(f"{k}={v!r}" for k, v in applied.items() if section in ("", k.split(".")[0]))


def apply_overrides(params_path: Path, overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """Write `overrides` into the params.yaml at `params_path`; return them as applied.

    The flow calls this only on the experiment workspace's copy (flows/experiment.py). All keys
    are checked before the file is touched, and the file is replaced atomically with its mode
    kept, so a bad override leaves the file exactly as it was.
    """
    from tasks.common.outputs import atomic_file

    if not overrides:
        return {}
    params_path = Path(params_path)
    rt, doc = _read_mapping(params_path)
    applied = _check_keys(doc, overrides, params_path.name)
    for dotted, value in applied.items():
        _set(doc, dotted, value)
    buf = io.StringIO()
    rt.dump(doc, buf)
    mode = params_path.stat().st_mode & 0o7777
    with atomic_file(params_path) as tmp:
        tmp.write_text(buf.getvalue())
        tmp.chmod(mode)
    return applied
