"""Strict params loading: errors name the dotted key and the fix."""
from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import Field, ValidationError

from tasks.common.config import StageConfig, load_config
from tasks.common.errors import UserError

pytestmark = pytest.mark.quick  # make test-fast


class Inner(StageConfig):
    min_score: float = Field(0.0, ge=0)


class Item(StageConfig):
    name: str = "x"


class Example(StageConfig):
    steps: int = Field(10, gt=0)
    inner: Inner = Inner()
    maybe: Inner | None = None
    items: list[Item] = []


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "params.yaml"
    path.write_text(text)
    return path


def test_valid_section_loads_and_is_frozen(tmp_path: Path) -> None:
    cfg = load_config("ex", Example, write(tmp_path, "ex:\n  steps: 3\n  inner: {min_score: 1.5}\n"))
    assert cfg.steps == 3 and cfg.inner.min_score == 1.5
    with pytest.raises(ValidationError):
        cfg.steps = 4  # type: ignore[misc]


def test_misspelt_key_names_the_dotted_path_and_known_keys(tmp_path: Path) -> None:
    with pytest.raises(UserError) as err:
        load_config("ex", Example, write(tmp_path, "ex:\n  inner: {min_scor: 1}\n"))
    assert "ex.inner.min_scor: unknown key" in str(err.value) and "min_score" in str(err.value)


@pytest.mark.parametrize(("text", "line"), [
    ("ex:\n  stpes: 3\n", "ex.stpes: unknown key (misspelt?). Did you mean 'ex.steps'?"),
    ("ex:\n  Steps: 3\n", "ex.Steps: unknown key (misspelt?). Did you mean 'ex.steps'?"),
    ("ex:\n  maybe: {min_scroe: 1}\n",
     "ex.maybe.min_scroe: unknown key (misspelt?). Did you mean 'ex.maybe.min_score'?"),
    ("ex:\n  items: [{nmae: a}]\n", "ex.items.0.nmae: unknown key (misspelt?). Did you mean 'ex.items.0.name'?"),
    ("ex:\n  zzz: 1\n", "ex.zzz: unknown key (misspelt?). 'ex' has no key like it."),
])
def test_a_misspelt_key_is_one_line_with_the_closest_key_and_not_the_whole_list(
        tmp_path: Path, text: str, line: str) -> None:
    with pytest.raises(UserError) as err:
        load_config("ex", Example, write(tmp_path, text))
    message = str(err.value)
    assert "\n" not in message, message
    assert message.startswith(f"{tmp_path / 'params.yaml'}: invalid parameters: {line} ")
    assert message.endswith("Every key of '" + line.split(":")[0].rpartition(".")[0] + "': docs/parameters.md")
    assert "Known keys" not in message and ", " not in message, "the section's keys are not listed"


def test_the_real_train_section_suggests_learning_rate(tmp_path: Path) -> None:
    from tasks.train.config import TrainConfig

    with pytest.raises(UserError) as err:
        load_config("train", TrainConfig, write(tmp_path, "train:\n  learning_rat: 1.0e-4\n"))
    assert str(err.value) == (f"{tmp_path / 'params.yaml'}: invalid parameters: train.learning_rat: unknown "
                              "key (misspelt?). Did you mean 'train.learning_rate'? Every key of 'train': "
                              "docs/parameters.md")


def test_several_errors_are_one_line_each(tmp_path: Path) -> None:
    with pytest.raises(UserError) as err:
        load_config("ex", Example, write(tmp_path, "ex:\n  stpes: 3\n  inner: {min_score: -1}\n"))
    lines = str(err.value).splitlines()
    assert lines[0].endswith("invalid parameters:") and len(lines) == 3
    assert any("Did you mean 'ex.steps'?" in line for line in lines)
    assert any(line.strip().startswith("ex.inner.min_score: Input should be greater") for line in lines)


def test_out_of_range_value(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"ex\.steps: Input should be greater than 0 \(got -1\)"):
        load_config("ex", Example, write(tmp_path, "ex:\n  steps: -1\n"))


def test_missing_section_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="section 'ex' is missing"):
        load_config("ex", Example, write(tmp_path, "other: {}\n"))
    with pytest.raises(UserError, match="not found"):
        load_config("ex", Example, tmp_path / "nope.yaml")


def test_invalid_yaml(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="not valid YAML"):
        load_config("ex", Example, write(tmp_path, "ex: [unclosed\n"))


def test_under_dvc_a_refused_stage_names_dvc_checkout_for_the_outputs_dvc_removed(tmp_path: Path) -> None:
    from tasks.common.errors import removed_outputs_note

    (tmp_path / "dvc.lock").write_text(
        "schema: '2.0'\nstages:\n  evaluate:\n    cmd: python -m tasks.evaluate\n    outs:\n"
        "    - path: reports/evaluate.json\n      md5: 0\n    - path: reports/evaluate\n      md5: 1.dir\n")
    dvc = {"DVC_STAGE": "evaluate", "DVC_ROOT": str(tmp_path)}
    note = removed_outputs_note(dvc, tmp_path)
    assert note.startswith("note: DVC removed this stage's last outputs before running it "
                           "(reports/evaluate.json, reports/evaluate);")
    assert "`dvc checkout evaluate`" in note and "\n" not in note
    assert removed_outputs_note({"DVC_STAGE": "dvc.yaml:evaluate"}, tmp_path) == note
    (tmp_path / "reports/evaluate").mkdir(parents=True)
    (tmp_path / "reports/evaluate.json").write_text("{}")
    assert removed_outputs_note(dvc, tmp_path) == "", "nothing gone: nothing to say"
    assert removed_outputs_note({}, tmp_path) == "", "not under dvc repro"
    assert removed_outputs_note({"DVC_STAGE": "train"}, tmp_path) == "", "a stage dvc.lock does not record"
