"""Overrides: validated against the stage configs without writing anything, written (into an
experiment's copy of params.yaml) like `dvc exp run --set-param`; stage order is dvc.yaml's."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from flows.params import apply_overrides, stage_output, validate_overrides
from flows.sections import SECTION_CONFIGS, section_config, stage_names
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


# --- keys the typed configs define that params.yaml leaves to their defaults (issue 45) ---------

def _documented_values() -> list[str]:
    """Every single-value key docs/parameters.md lists (list items, `[]`, are not dotted keys)."""
    from flows.params import config_keys

    return [path for section in SECTION_CONFIGS for path, kind in config_keys(section).items()
            if kind != "group" and "[]" not in path]


def test_config_keys_are_the_documented_ones() -> None:
    doc = (REPO / "docs" / "parameters.md").read_text()
    keys = _documented_values()
    assert {"train.lora_type", "train.rank", "train.fuse_lora"} <= set(keys)
    assert all(f"| `{key}` |" in doc for key in keys)


def test_every_documented_key_can_be_overridden(params: Path) -> None:
    """`--set` used to accept only keys written in params.yaml."""
    keys = _documented_values()
    assert apply_overrides(params, dict.fromkeys(keys)) == dict.fromkeys(keys)
    data = yaml.safe_load(params.read_text())
    for key in keys:
        node = data
        for part in key.split("."):
            node = node[part]
        assert node is None, key


def test_a_key_params_yaml_leaves_out_is_validated_added_and_read_by_the_stage(params: Path) -> None:
    from tasks.common.config import load_config
    from tasks.train.config import TrainConfig

    overrides = {"train.method": "lora", "train.lora_type": "dora", "train.rank": 8,
                 "train.checkpoint_scoring.clip_revision": "abc123", "ingest.captioner.mode": "missing"}
    before = params.read_text()
    assert "lora_type" not in yaml.safe_load(before)["train"]
    assert validate_overrides(params, overrides) == overrides
    assert params.read_text() == before  # validating writes nothing
    apply_overrides(params, overrides)
    after = params.read_text()
    cfg = load_config("train", TrainConfig, params)  # what `python -m tasks.train` reads
    assert (cfg.method, cfg.lora_type, cfg.rank) == ("lora", "dora", 8)
    assert cfg.checkpoint_scoring.clip_revision == "abc123"
    assert yaml.safe_load(after)["ingest"]["captioner"] == {"mode": "missing"}
    removed = set(before.splitlines()) - set(after.splitlines())
    assert {line.split("#")[0].strip() for line in removed} == {
        "method: dreambooth", "captioner: null"}  # every other line, comments included, stays


@pytest.mark.parametrize(("overrides", "expected"), [
    ({"train.method": "lora", "train.lora_type": "dorra"}, "train.lora_type: Input should be"),
    ({"train.rank": 8}, "rank is set to 8, but only method: lora reads it"),
    ({"train.method": "lora", "train.rank": 0}, "train.rank: Input should be greater than or equal to 1"),
])
def test_a_bad_value_for_an_unwritten_key_fails_naming_it(params: Path, overrides: dict,
                                                           expected: str) -> None:
    before = params.read_bytes()
    with pytest.raises(UserError) as err:
        validate_overrides(params, overrides)
    assert expected in str(err.value)
    assert params.read_bytes() == before


@pytest.mark.parametrize(("key", "expected", "known"), [
    ("train.lora_typ", "Did you mean 'train.lora_type'?", "fuse_lora"),
    ("train.checkpoint_scoring.clip_revison",
     "Did you mean 'train.checkpoint_scoring.clip_revision'?", "dino_revision"),
    ("train.rank.value", "no key 'value' in section 'train.rank'", "(none)"),
])
def test_an_unknown_key_names_the_config_the_fix_and_the_reference(
        params: Path, key: str, expected: str, known: str) -> None:
    with pytest.raises(UserError, match="misspelt") as err:
        validate_overrides(params, {key: 1})
    message = str(err.value)
    assert f"override '{key}'" in message and expected in message
    assert "nor does TrainConfig define it" in message and "docs/parameters.md" in message
    assert known in message.partition("Known keys there:")[2]  # unwritten keys are known too


def test_a_mapping_typed_key_takes_a_mapping_a_group_does_not(params: Path) -> None:
    assert validate_overrides(params, {"train.launch.env": {"OMP_PROC_BIND": "close"}})
    with pytest.raises(UserError, match="not whole sections"):
        validate_overrides(params, {"train.checkpoint_scoring": {"metric": "dino"}})


@pytest.mark.parametrize(("argv", "expected"), [
    (["--set", "train.lora_type=dora"], "lora_type is set to 'dora', but only method: lora reads it"),
    (["--set", "train.lora_typ=dora"], "Did you mean 'train.lora_type'?"),
    (["--set", "train.method=lora", "--set", "train.rank=-1"], "train.rank: Input should be greater"),
])
def test_cli_refuses_a_bad_set_before_the_flow_starts(argv: list[str], expected: str,
                                                      monkeypatch, capsys) -> None:
    """The flow (and so Prefect's server) is never started for a bad `--set`."""
    import sys

    import flows.finetune as finetune_module

    started: list[dict] = []
    monkeypatch.setattr(finetune_module, "finetune", lambda **kwargs: started.append(kwargs))
    monkeypatch.setattr(sys, "argv", ["flows.finetune", *argv])
    with pytest.raises(SystemExit) as exit_:
        finetune_module.main()
    assert exit_.value.code == 2 and not started
    assert expected in capsys.readouterr().err


def test_cli_passes_a_good_set_of_unwritten_keys_to_the_flow(monkeypatch) -> None:
    import sys

    import flows.finetune as finetune_module

    calls: list[str] = []
    started: list[dict] = []
    monkeypatch.setattr(finetune_module, "finetune",
                        lambda **kwargs: calls.append("flow") or started.append(kwargs))
    monkeypatch.setattr(finetune_module.experiment, "require_git", lambda root: calls.append("git"))
    monkeypatch.setattr(sys, "argv", ["flows.finetune", "--set", "train.method=lora", "--set",
                                      "train.lora_type=dora", "--set", "train.fuse_lora=false"])
    finetune_module.main()
    assert calls == ["git", "flow"]  # checked before the flow (and its server) starts
    assert [s["overrides"] for s in started] == [
        {"train.method": "lora", "train.lora_type": "dora", "train.fuse_lora": False}]
