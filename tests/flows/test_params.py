"""Overrides: validated against the stage configs without writing anything, written (into an
experiment's copy of params.yaml) like `dvc exp run --set-param`; stage order is dvc.yaml's."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from flows.params import (
    SECTION_CONFIGS,
    apply_overrides,
    section_config,
    stage_names,
    stage_output,
    validate_overrides,
)
from tasks.common.errors import UserError
from tests.conftest import REPO


@pytest.fixture
def params(tmp_path: Path) -> Path:
    dst = tmp_path / "params.yaml"
    shutil.copy(REPO / "params.yaml", dst)
    return dst


def test_override_changes_only_the_value_and_keeps_every_comment(params: Path) -> None:
    before = params.read_text()
    applied = apply_overrides(params, {"train.max_train_steps": 5, "evaluate.gate.min_clip_t": 0.25})
    after = params.read_text()
    assert applied == {"train.max_train_steps": 5, "evaluate.gate.min_clip_t": 0.25}
    data = yaml.safe_load(after)
    assert data["train"]["max_train_steps"] == 5
    assert data["evaluate"]["gate"]["min_clip_t"] == 0.25
    # Everything else is byte-for-byte the same, comments included.
    changed = [(a, b) for a, b in zip(before.splitlines(), after.splitlines()) if a != b]
    assert len(before.splitlines()) == len(after.splitlines())
    assert [b.split("#")[0].strip() for _, b in changed] == ["max_train_steps: 5", "min_clip_t: 0.25"]
    comments = [line[line.index("#"):] for line in before.splitlines() if "#" in line]
    assert comments and all(c in after for c in comments)


def test_lists_and_strings_keep_their_types(params: Path) -> None:
    apply_overrides(params, {"evaluate.prompts": ["a {identifier} {class_name}"],
                             "base.model": "builtin:tiny-sdxl"})
    data = yaml.safe_load(params.read_text())
    assert data["evaluate"]["prompts"] == ["a {identifier} {class_name}"]
    assert data["base"]["model"] == "builtin:tiny-sdxl"


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("train.max_train_step", "no key 'max_train_step' in section 'train'"),
        ("trian.seed", "no key 'trian' in the top level"),
        ("evaluate.gate.min_clipt", "no key 'min_clipt' in section 'evaluate.gate'"),
        ("train.seed.value", "no key 'value' in section 'train.seed'"),
    ],
)
def test_unknown_key_is_rejected_and_params_untouched(params: Path, key: str, expected: str) -> None:
    before = params.read_text()
    with pytest.raises(UserError, match="misspelt") as err:
        apply_overrides(params, {"train.seed": 3, key: 1})
    assert expected in str(err.value)
    assert f"override '{key}'" in str(err.value)
    assert params.read_text() == before  # the valid override before it was not written either


def test_whole_section_cannot_be_replaced(params: Path) -> None:
    with pytest.raises(UserError, match="not whole sections"):
        apply_overrides(params, {"evaluate.gate": {"min_clip_t": 0.3}})


def test_no_overrides_leaves_the_file_alone(params: Path) -> None:
    mtime = params.stat().st_mtime_ns
    assert apply_overrides(params, None) == {}
    assert apply_overrides(params, {}) == {}
    assert params.stat().st_mtime_ns == mtime


def test_stage_names_follow_dvc_yaml_order(tmp_path: Path) -> None:
    assert stage_names(REPO / "dvc.yaml") == list(yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"])
    custom = tmp_path / "dvc.yaml"
    custom.write_text("".join(f"  {name}:\n    cmd: 'true'\n" for name in ("zeta", "alpha", "mid")))
    custom.write_text("stages:\n" + custom.read_text())
    assert stage_names(custom) == ["zeta", "alpha", "mid"]


def test_stage_names_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="not found"):
        stage_names(tmp_path / "dvc.yaml")
    (tmp_path / "dvc.yaml").write_text("vars: []\n")
    with pytest.raises(UserError, match="no 'stages'"):
        stage_names(tmp_path / "dvc.yaml")


def test_output_paths_come_from_dvc_yaml_s_commands(tmp_path: Path) -> None:
    """flows/ reads a stage's output path from the argument dvc.yaml gives its command."""
    dvc_yaml = REPO / "dvc.yaml"
    stages = yaml.safe_load(dvc_yaml.read_text())["stages"]
    for stage, flag in (("base", "--out"), ("train", "--out"), ("export", "--out"), ("evaluate", "--report")):
        got = stage_output(dvc_yaml, stage, flag)
        assert got is not None and f"{flag} {got.as_posix()}" in stages[stage]["cmd"]
    assert stage_output(dvc_yaml, "train", "--no-such-flag") is None
    assert stage_output(dvc_yaml, "no_such_stage", "--out") is None

    custom = tmp_path / "dvc.yaml"
    (tmp_path / "params.yaml").write_text("a:\n  dir: out/a\n")
    custom.write_text(yaml.safe_dump({"stages": {
        "a": {"cmd": ["echo", "python a.py --out=${a.dir} --report r.json --input in"],
              "outs": ["${a.dir}"], "metrics": [{"r.json": {"cache": False}}]},
    }}))
    assert stage_output(custom, "a", "--out") == Path("out/a")  # `--flag=value`, `${key}` from params.yaml
    assert stage_output(custom, "a", "--report") == Path("r.json")  # a metric with options
    with pytest.raises(UserError, match="stage 'a' is given --input in, which is not among its outs"):
        stage_output(custom, "a", "--input")


def test_cli_set_values_are_typed_like_yaml() -> None:
    from flows.finetune import _parse_set

    assert _parse_set(["train.max_train_steps=5", "train.mixed_precision=bf16",
                       "base.revision=null", "ingest.center_crop=false"]) == {
        "train.max_train_steps": 5, "train.mixed_precision": "bf16",
        "base.revision": None, "ingest.center_crop": False}
    with pytest.raises(UserError, match="expected KEY=VALUE"):
        _parse_set(["train.max_train_steps"])


def test_cli_reports_a_malformed_set_without_traceback() -> None:
    import os
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "flows.finetune", "--set", "train.seed"], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert "expected KEY=VALUE" in proc.stderr and "Traceback" not in proc.stderr


def test_every_params_section_has_its_stage_config() -> None:
    sections = yaml.safe_load((REPO / "params.yaml").read_text())
    assert set(SECTION_CONFIGS) == set(sections)
    for name, data in sections.items():
        section_config(name).model_validate(data)  # the table names the class that reads it


@pytest.mark.parametrize(("overrides", "expected"), [
    ({"train.learning_rate": "abc"}, "train.learning_rate: Input should be a valid number"),
    ({"train.max_train_steps": 0}, "train.max_train_steps: Input should be greater than"),
    ({"export.compression.mode": "int3"}, "export.compression.mode: Input should be"),
    ({"train.seed": 1, "base.model": 5}, "base.model: Input should be a valid string"),
])
def test_a_value_the_stage_config_refuses_fails_naming_the_key(
        params: Path, overrides: dict, expected: str) -> None:
    params.chmod(0o640)
    before, mode = params.read_bytes(), params.stat().st_mode
    with pytest.raises(UserError) as err:
        validate_overrides(params, overrides)
    assert expected in str(err.value)
    assert params.read_bytes() == before and params.stat().st_mode == mode


def test_valid_overrides_are_returned_and_nothing_is_written(params: Path) -> None:
    before = params.read_bytes()
    assert validate_overrides(params, {"train.max_train_steps": 5, "evaluate.seed": 3}) == {
        "train.max_train_steps": 5, "evaluate.seed": 3}
    assert params.read_bytes() == before
    with pytest.raises(UserError, match="override 'train.learnig_rate'"):
        validate_overrides(params, {"train.learnig_rate": 1e-4})


def test_apply_keeps_the_file_mode(params: Path) -> None:
    params.chmod(0o640)
    apply_overrides(params, {"train.max_train_steps": 5})
    assert params.stat().st_mode & 0o777 == 0o640


def test_cli_bad_override_fails_at_once_and_leaves_params_yaml_alone() -> None:
    """The issue's case: `--set train.learning_rate=abc` used to land in params.yaml (mode 0600)."""
    import os
    import subprocess
    import sys

    before, mode = (REPO / "params.yaml").read_bytes(), (REPO / "params.yaml").stat().st_mode
    proc = subprocess.run([sys.executable, "-m", "flows.finetune", "--set",
                           "train.learning_rate=abc"], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "train.learning_rate: Input should be a valid number" in proc.stderr
    assert "Running stage" not in proc.stdout + proc.stderr
    assert (REPO / "params.yaml").read_bytes() == before
    assert (REPO / "params.yaml").stat().st_mode == mode
