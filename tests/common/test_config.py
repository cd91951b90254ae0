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


class Example(StageConfig):
    steps: int = Field(10, gt=0)
    inner: Inner = Inner()


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
