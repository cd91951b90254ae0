"""docs/parameters.md is what `python -m flows.params_doc --write` makes of the stage configs,
and it names every key params.yaml sets. Fast: imports the config classes, loads no model."""
from __future__ import annotations

import enum
import re
import shutil
from pathlib import Path
from typing import Literal

import pytest
import yaml
from pydantic import Field

from flows import params_doc
from flows.params_doc import COMMAND, DOC, ITEM, MissingDescriptions, generate, sections, tables
from tasks.common.config import StageConfig
from tests.conftest import REPO

pytestmark = pytest.mark.quick  # make test-fast

ROW = re.compile(r"^\| `([^`]+)` \| [^|]*(?:\\\|[^|]*)* \| (.*)$")


def documented(text: str) -> dict[str, bool]:
    """Dotted key -> whether it is a leaf (False: a group, or a list of typed items, whose keys have
    their own tables)."""
    keys = {}
    for line in text.splitlines():
        if m := ROW.match(line):
            keys[m.group(1)] = "[keys below]" not in m.group(2) and "items by `" not in m.group(2)
    return keys


def yaml_keys(data: object, path: str, known: dict[str, bool]) -> list[str]:
    """The dotted keys of `data` that the reference lacks; a documented leaf ends the walk (its
    value may be a mapping or a list, e.g. `launch.env`, `xla.mesh_shape`)."""
    if known.get(path):
        return []
    if isinstance(data, dict):
        return [m for k, v in data.items() for m in yaml_keys(v, f"{path}.{k}" if path else str(k), known)]
    if isinstance(data, list) and path + ITEM + ".type" in known:  # a list of typed items (ingest.sources)
        return [m for item in data for m in yaml_keys(item, path + ITEM, known)]
    return [] if path in known else [path]


def test_the_reference_is_what_the_configs_give() -> None:
    try:
        text, _ = generate(REPO)
    except MissingDescriptions as err:
        pytest.fail("keys without a description (add Field(description=...) where named):\n" + str(err))
    current = (REPO / DOC).read_text() if (REPO / DOC).is_file() else ""
    assert current == text, f"{DOC} is out of date with the stage configs: run `{COMMAND}` (or make params-doc)"


def test_every_key_of_params_yaml_is_in_the_reference() -> None:
    known = documented((REPO / DOC).read_text())
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    missing = yaml_keys(params, "", known)
    assert not missing, f"params.yaml keys missing from {DOC} (a section without a config class in " \
                        f"flows/params.py SECTION_CONFIGS, or a stale file: run `{COMMAND}`): {missing}"
    assert set(params) == {s for s, _ in sections(REPO)}


def test_the_key_walk_finds_keys_the_reference_lacks() -> None:
    known = documented((REPO / DOC).read_text())
    params = {"train": {"seed": 1, "bogus": 2, "launch": {"env": {"ANY": "1"}, "nmu_processes": 2}},
              "ingest": {"sources": [{"type": "hub", "name": "a/b", "nme": "x"}]}, "extra": {"k": 1}}
    assert yaml_keys(params, "", known) == ["train.bogus", "train.launch.nmu_processes",
                                            "ingest.sources[].nme", "extra.k"]


def test_sections_follow_dvc_yaml_then_register_and_each_has_its_keys() -> None:
    text, keys = generate(REPO)
    order = [s for s, _ in sections(REPO)]
    assert order == ["base", "ingest", "class_images", "train", "export", "evaluate", "register"]
    headings = [line[4:-1] for line in text.splitlines() if line.startswith("## `")]
    assert headings == order
    leaves = [k for k in keys if k.leaf]
    assert len(leaves) > 200 and f"{len(leaves)} parameters" in text
    rows = documented(text)
    for path in ("train.learning_rate", "train.launch.num_processes", "evaluate.gate.min_dino",
                 "ingest.sources[].metadata_dir", "export.compression.mode", "register.model_name"):
        assert rows[path], path
    assert not rows["train.xla"] and not rows["evaluate.gate"] and not rows["ingest.sources"]
    line = next(x for x in text.splitlines() if x.startswith("| `train.learning_rate` |"))
    assert line == ("| `train.learning_rate` | float | `0.0001` | > 0.0, <= 1.0 | peak learning rate (before "
                    "scale_lr); prodigy: a multiplier of its own estimate, 1.0 |")
    line = next(x for x in text.splitlines() if x.startswith("| `train.mixed_precision` |"))
    assert "`'no'`, `bf16`, `fp16`" in line, "Literal members, as YAML must write them"


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Inner(StageConfig):
    """An inner group."""

    depth: int = Field(3, gt=0, lt=10, multiple_of=1, description="how deep")


class Toy(StageConfig):
    """The toy section."""

    mode: Literal["a", "b"] | None = Field(None, description="a | b")
    color: Color = Field(Color.RED, description="a colour")
    name: str = Field(pattern=r"^x+$", max_length=4, description="required, x's")
    ratio: float = Field(0.5, ge=0.0, le=1.0)
    inner: Inner = Field(default_factory=Inner)
    path: Path = Field(Path("a/b"), description="a <folder>")


def test_a_field_without_description_is_named_and_the_rest_is_rendered() -> None:
    missing: list[str] = []
    found = list(tables("toy", Toy, missing))
    assert missing == [f"toy.ratio: {__name__}.Toy.ratio has no Field(description=...)"]
    assert [t.heading for t in found] == ["`toy`", "`toy.inner`"]
    rows = {k.path: k for t in found for k in t.keys}
    assert (rows["toy.mode"].type, rows["toy.mode"].default, rows["toy.mode"].allowed) == \
        ("str | null", "`null`", "`a`, `b`")
    assert (rows["toy.color"].type, rows["toy.color"].default, rows["toy.color"].allowed) == \
        ("str", "`red`", "`red`, `blue`")
    assert (rows["toy.name"].default, rows["toy.name"].allowed) == ("required", "length <= 4, matches `^x+$`")
    assert rows["toy.ratio"].allowed == ">= 0.0, <= 1.0"
    assert rows["toy.inner.depth"].allowed == "> 0, < 10, multiple of 1"
    assert not rows["toy.inner"].leaf and rows["toy.inner"].description == "An inner group."
    assert (rows["toy.path"].type, rows["toy.path"].default) == ("path", "`a/b`")
    rendered = "\n".join(params_doc._render_table(found[0]))
    assert "| a \\| b |" in rendered and "a \\<folder>" in rendered and "[keys below](#toyinner)" in rendered


def test_check_fails_on_a_stale_file_and_write_fixes_it(tmp_path: Path, monkeypatch, capsys) -> None:
    shutil.copy(REPO / "dvc.yaml", tmp_path / "dvc.yaml")
    monkeypatch.setattr(params_doc, "ROOT", tmp_path)
    assert params_doc.main(["--check"]) == 1
    assert COMMAND in capsys.readouterr().err
    assert params_doc.main(["--write"]) == 0
    assert (tmp_path / DOC).read_text() == (REPO / DOC).read_text()
    assert params_doc.main([]) == 0
    (tmp_path / DOC).write_text((tmp_path / DOC).read_text().replace("peak learning rate", "learning rate"))
    assert params_doc.main(["--check"]) == 1


def test_check_names_keys_without_a_description(monkeypatch, capsys) -> None:
    monkeypatch.setattr(params_doc, "sections", lambda root=None: [("toy", Toy)])
    assert params_doc.main(["--check"]) == 1
    assert f"toy.ratio: {__name__}.Toy.ratio has no Field(description=...)" in capsys.readouterr().err
