"""The parameter reference, docs/parameters.md, generated from the typed stage configs:
`python -m flows.params_doc --check | --write`.

Every params.yaml section is read by one pydantic class (flows/params.py, SECTION_CONFIGS). This
walks each class, nested models and the `ingest.sources` types included, and writes one section
per stage in dvc.yaml's order, then the sections dvc.yaml has no stage for (`register`, the flow's
last step). Each key gets its dotted path, type, default, allowed values (Literal members, enum
values, the bounds of `Field` constraints such as ge/gt/le/lt, lengths, patterns) and its
`Field(description=...)`; a nested model without one is described by its class docstring, and the
`type` of a list item (`ingest.sources[].type`) by the table it opens. The text comes from the code
only (declaration order, no dates), so the same configs give the same file.

- `--check` (the default): exit 1 when docs/parameters.md differs from what the configs give, or
  when a key has no description (naming the class and the field: add `description=` there);
  tests/flows/test_params_doc.py runs the same comparison;
- `--write`: rewrite docs/parameters.md (refused while a key has no description).
"""
from __future__ import annotations

import argparse
import enum
import inspect
import re
import sys
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import annotated_types
import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

ROOT = Path(__file__).resolve().parents[1]
DOC = Path("docs/parameters.md")
COMMAND = "python -m flows.params_doc --write"
#: `<section>.<list key>[]` marks the items of a list of models (ingest.sources).
ITEM = "[]"


class MissingDescriptions(Exception):
    """Keys without `Field(description=...)`: one line per key, naming its class and field."""

    def __init__(self, missing: list[str]) -> None:
        super().__init__("\n".join(missing))
        self.missing = missing


@dataclass(frozen=True)
class Key:
    """One documented key: a value, a group of keys (a nested model, `link` to its table) or a
    list of typed items (`link`: the tables of the item types)."""

    path: str
    type: str
    default: str
    allowed: str
    description: str
    kind: Literal["value", "group", "items"] = "value"
    link: str = ""  # markdown, not escaped

    @property
    def leaf(self) -> bool:
        """A parameter of its own (a list of items is one; a group's keys are counted instead)."""
        return self.kind != "group"


@dataclass(frozen=True)
class Table:
    """The keys of one model: a section, a nested model, or one type of a list's items."""

    heading: str
    intro: str
    keys: tuple[Key, ...]
    level: int


def sections(root: Path = ROOT) -> list[tuple[str, type[BaseModel]]]:
    """(section, config class): the stages in dvc.yaml's order, then the other sections."""
    from flows.sections import SECTION_CONFIGS, section_config, stage_names

    order = [s for s in stage_names(root / "dvc.yaml") if s in SECTION_CONFIGS]
    order += [s for s in SECTION_CONFIGS if s not in order]
    found = []
    for section in order:
        model = section_config(section)
        assert model is not None
        found.append((section, model))
    return found


# --- describing one field ---------------------------------------------------------------------

def _strip_annotated(tp: Any) -> Any:
    while typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    return tp


def _union_args(tp: Any) -> tuple[Any, ...]:
    tp = _strip_annotated(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return tuple(_strip_annotated(a) for a in typing.get_args(tp))
    return (tp,)


def _model_of(tp: Any) -> type[BaseModel] | None:
    """The model a field holds (also when it may be null), else None."""
    models = [a for a in _union_args(tp) if isinstance(a, type) and issubclass(a, BaseModel)]
    return models[0] if len(models) == 1 else None


def _item_models(tp: Any) -> list[type[BaseModel]]:
    """The models of a list's items (a discriminated union gives several), else []."""
    tp = _strip_annotated(tp)
    if typing.get_origin(tp) is not list:
        return []
    (item,) = typing.get_args(tp)
    models = [a for a in _union_args(item) if isinstance(a, type) and issubclass(a, BaseModel)]
    return models if len(models) == len(_union_args(item)) else []


def type_name(tp: Any) -> str:
    """How a YAML writer sees a type: `int`, `float | null`, `list[str]`, `path`, `mapping`."""
    tp = _strip_annotated(tp)
    origin = typing.get_origin(tp)
    if tp is type(None):
        return "null"
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        names = [type_name(a) for a in args if a is not type(None)]
        if type(None) in args:
            names.append("null")
        return " | ".join(dict.fromkeys(names))
    if origin is Literal:
        return " | ".join(dict.fromkeys(type_name(type(v)) for v in typing.get_args(tp)))
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return " | ".join(dict.fromkeys(type_name(type(m.value)) for m in tp))
    if origin in (list, tuple, set, frozenset):
        args = typing.get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            return "[" + ", ".join(type_name(a) for a in args) + "]"
        return f"list[{type_name(args[0])}]" if args else "list"
    if origin is dict:
        key, value = typing.get_args(tp)
        return f"mapping[{type_name(key)}, {type_name(value)}]"
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return "mapping"
    if isinstance(tp, type) and issubclass(tp, Path):
        return "path"
    names = {str: "str", int: "int", float: "float", bool: "bool"}
    if tp in names:
        return names[tp]
    return getattr(tp, "__name__", str(tp))


def allowed_values(field: FieldInfo) -> list[str]:
    """Literal members and enum values, then the constraints `Field` was given."""
    allowed: list[str] = []
    for arg in _union_args(field.annotation):
        if typing.get_origin(arg) is Literal:
            allowed += [_code(v) for v in typing.get_args(arg)]
        elif isinstance(arg, type) and issubclass(arg, enum.Enum):
            allowed += [_code(m.value) for m in arg]
    words = {
        annotated_types.Gt: ("gt", "> {}"), annotated_types.Ge: ("ge", ">= {}"),
        annotated_types.Lt: ("lt", "< {}"), annotated_types.Le: ("le", "<= {}"),
        annotated_types.MultipleOf: ("multiple_of", "multiple of {}"),
        annotated_types.MinLen: ("min_length", "length >= {}"),
        annotated_types.MaxLen: ("max_length", "length <= {}"),
    }
    for item in field.metadata:
        if type(item) in words:
            attr, text = words[type(item)]
            allowed.append(text.format(_plain(getattr(item, attr))))
        elif getattr(item, "pattern", None):
            allowed.append(f"matches `{item.pattern}`")
    return allowed


def _plain(value: Any) -> Any:
    """A value as YAML would hold it: paths as strings, tuples as lists, models as mappings."""
    if isinstance(value, BaseModel):
        return _plain(value.model_dump(exclude_unset=True))
    if isinstance(value, Path):
        return value.as_posix()
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(_plain(v) for v in value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in sorted(value.items())}
    return value


def _yaml(value: Any) -> str:
    text = yaml.safe_dump(_plain(value), default_flow_style=True, width=10_000, sort_keys=True)
    return text.removesuffix("\n").removesuffix("\n...").strip()


def _code(value: Any) -> str:
    return f"`{_yaml(value)}`"


def default_of(field: FieldInfo) -> str:
    if field.default_factory is not None:
        return _code(field.default_factory())  # type: ignore[call-arg]
    if field.default is PydanticUndefined:
        return "required"
    return _code(field.default)


def _doc_first_paragraph(obj: Any) -> str:
    doc = inspect.cleandoc(obj.__doc__ or "")
    return " ".join(doc.split("\n\n")[0].split())


def _description(field: FieldInfo) -> str:
    return " ".join((field.description or "").split())


# --- walking the configs ------------------------------------------------------------------------

def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"<[^>]+>", "", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _heading(path: str, item_type: tuple[str, str] | None = None) -> str:
    """`train.xla`; for one type of a list's items, `ingest.sources[]` (type: `folder`)."""
    return f"`{path}`" + (f" ({item_type[0]}: `{item_type[1]}`)" if item_type else "")


def tables(section: str, model: type[BaseModel], missing: list[str]) -> Iterator[Table]:
    """The section's table, then one per nested model or list item type, depth first, in order."""
    yield from _tables(section, model, _doc_first_paragraph(model), 2, missing)


def _tables(path: str, model: type[BaseModel], intro: str, level: int, missing: list[str],
            item_type: tuple[str, str] | None = None) -> Iterator[Table]:
    keys: list[Key] = []
    below: list[tuple[str, type[BaseModel], tuple[str, str] | None]] = []
    for name, field in model.model_fields.items():
        dotted = f"{path}.{name}"
        nested, items = _model_of(field.annotation), _item_models(field.annotation)
        description = _description(field)
        if nested is not None:
            description = description or _doc_first_paragraph(nested)
        if item_type is not None and name == item_type[0]:  # the discriminator: `type: folder`
            description = description or f"`{item_type[1]}` for an item with the keys of this table"
        if not description:
            missing.append(f"{dotted}: {model.__module__}.{model.__qualname__}.{name} has no "
                           "Field(description=...)")
        type_ = type_name(field.annotation)
        if nested is not None:
            link = f"[keys below](#{slug(_heading(dotted))})"
            keys.append(Key(dotted, type_, "", "", description, "group", link))
            below.append((dotted, nested, None))
        elif items and (tag := _discriminator(items)):
            kinds = [(tag, str(_tag_value(item, tag))) for item in items]
            link = f"items by `{tag}`: " + ", ".join(
                f"[`{kind}`](#{slug(_heading(dotted + ITEM, (tag, kind)))})" for _, kind in kinds)
            keys.append(Key(dotted, type_, default_of(field), "", description, "items", link))
            below += [(dotted + ITEM, item, kind) for item, kind in zip(items, kinds)]
        elif len(items) == 1:  # a list of one model (train.concepts): its items' keys in a table of their own
            link = f"[item keys below](#{slug(_heading(dotted + ITEM))})"
            keys.append(Key(dotted, type_, default_of(field), "", description, "items", link))
            below.append((dotted + ITEM, items[0], None))
        else:
            keys.append(Key(dotted, type_, default_of(field), ", ".join(allowed_values(field)), description))
    yield Table(_heading(path, item_type), intro, tuple(keys), level)
    for dotted, nested, kind in below:
        yield from _tables(dotted, nested, _doc_first_paragraph(nested), 3, missing, kind)


def _discriminator(models: list[type[BaseModel]]) -> str | None:
    """The Literal field every item type has with its own single value (`type`), if any."""
    common = set.intersection(*(set(m.model_fields) for m in models))
    for name in sorted(common):
        if all(_tag_value(m, name) for m in models):
            return name
    return None


def _tag_value(model: type[BaseModel], tag: str | None) -> str | None:
    field = model.model_fields.get(tag or "")
    if field is None or typing.get_origin(field.annotation) is not Literal:
        return None
    values = typing.get_args(field.annotation)
    return str(values[0]) if len(values) == 1 else None


# --- the document ---------------------------------------------------------------------------------

def _cell(text: str) -> str:
    """Text for a table cell, on one line: `|` escaped (GitHub wants that in code spans too), and
    `<` outside code spans (`<checkpoint folder>` would be read as an HTML tag)."""
    parts = " ".join(text.split()).replace("|", "\\|").split("`")
    return "`".join(part if i % 2 else re.sub(r"<(?=[A-Za-z/!?])", r"\\<", part) for i, part in enumerate(parts))


def _render_table(table: Table) -> list[str]:
    lines = [f"{'#' * table.level} {table.heading}", ""]
    if table.intro:
        lines += [_cell(table.intro), ""]
    lines += ["| key | type | default | allowed values | description |", "|---|---|---|---|---|"]
    for key in table.keys:
        default = key.link if key.kind == "group" else _cell(key.default)
        allowed = key.link if key.kind == "items" else _cell(key.allowed)
        lines.append(f"| `{key.path}` | {_cell(key.type)} | {default} | {allowed} | {_cell(key.description)} |")
    return lines + [""]


def generate(root: Path = ROOT) -> tuple[str, list[Key]]:
    """The reference's text and its keys; MissingDescriptions when a key has none."""
    from flows.sections import stage_names

    missing: list[str] = []
    parts: list[tuple[str, type[BaseModel], list[Table]]] = []
    for section, model in sections(root):
        parts.append((section, model, list(tables(section, model, missing))))
    if missing:
        raise MissingDescriptions(missing)
    keys = [k for _, _, ts in parts for t in ts for k in t.keys]
    count = sum(k.leaf for k in keys)
    stages = stage_names(root / "dvc.yaml")
    extra = ", ".join(f"`{s}`" for s, _, _ in parts if s not in stages)
    lines = [
        "# Parameters",
        "",
        f"<!-- Generated from the typed stage configs by `{COMMAND}`; do not edit by hand. -->",
        "",
        "Every key of `params.yaml`, from the pydantic classes the stages read their sections into.",
        f"After changing a config class run `{COMMAND}`",
        "(tests/flows/test_params_doc.py fails while this file is out of date).",
        "",
        "Each stage reads only its own section: an unknown key, a wrong type or a value outside the",
        "allowed ones stops the stage before it does anything, naming the key. A key left out takes",
        "its default; `null` means \"not set\" where the type allows it (the description says what",
        "happens then). `params.yaml` holds the offline demo's values (the built-in tiny model at",
        "64 px); what the stages do: [docs/pipeline.md, \"The stages\"](pipeline.md#the-stages).",
        "",
        f"{count} parameters: one section per stage in dvc.yaml's order, then {extra} (the flow's",
        "last step, after the stages).",
        "",
    ]
    for section, model, _ in parts:
        where = f"{model.__module__.replace('.', '/')}.py"
        lines.append(f"- [`{section}`](#{slug(_heading(section))}): `{model.__name__}` in "
                     f"[{where}](../{where})")
    lines.append("")
    for _, _, section_tables in parts:
        for table in section_tables:
            lines += _render_table(table)
    return "\n".join(lines).rstrip("\n") + "\n", keys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 when docs/parameters.md is out of date (default)")
    mode.add_argument("--write", action="store_true", help="rewrite docs/parameters.md")
    args = parser.parse_args(argv)
    try:
        text, keys = generate(ROOT)
    except MissingDescriptions as err:
        print("keys without a description (add Field(description=...) in the config class):", file=sys.stderr)
        for line in err.missing:
            print(f"  {line}", file=sys.stderr)
        return 1
    path = ROOT / DOC
    count = sum(k.leaf for k in keys)
    if args.write:
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)
            print(f"wrote {DOC}: {count} parameters")
        else:
            print(f"{DOC} is up to date: {count} parameters")
        return 0
    if not path.is_file() or path.read_text() != text:
        print(f"{DOC} is not what the configs give; run `{COMMAND}`", file=sys.stderr)
        return 1
    print(f"{DOC} is up to date: {count} parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
