"""The bad-input sweep: every door a user opens, each bad value with the error it must give and the
proof that nothing was left half-done (params.yaml byte-identical, no output written, no MLflow run).

Doors: params.yaml (each stage's CLI with one bad value), the stages' CLI arguments, the flow's
parameters (`overrides`, `python -m flows.finetune --set`), and the serving endpoint: its tables
are tests/runtime/test_request_inputs.py (every bad request, no model needed) and
tests/register/test_model_serving.py (the same refusals as HTTP 400 from `mlflow models serve`).
Everything here fails at config or argument level, before any model loads: the sweep takes seconds.
"""
from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO, stage_runs

pytestmark = pytest.mark.quick  # make test-fast

#: stage -> its CLI arguments; every path is under the test's folder and must not appear.
OUTPUTS = {
    "base": ["--out", "models/base"],
    "ingest": ["--out", "data/processed", "--report", "ingest.json", "--rejected", "rejected.jsonl"],
    "class_images": ["--base", "models/base", "--out", "data/class", "--report", "class.json"],
    "train": ["--base", "models/base", "--data", "data/processed", "--class-data", "data/class",
              "--out", "models/finetuned", "--report", "train.json", "--plot", "loss.csv"],
    "export": ["--model", "models/finetuned", "--base", "models/base", "--out", "models/openvino",
               "--report", "export.json"],
    "evaluate": ["--model", "models/openvino", "--base", "models/base", "--instance-data", "data/processed",
                 "--out", "plots", "--report", "evaluate.json"],
    "register": ["--finetuned", "models/finetuned", "--openvino", "models/openvino", "--evaluation",
                 "evaluate.json"],
}

PARAMS = [
    # (stage, dotted key, bad value, the error)
    ("base", "base.model", " ", r"base.model: Value error, must name a model"),
    ("base", "base.seed", -1, r"base.seed: Input should be greater than or equal to 0 \(got -1\)"),
    ("base", "base.modle", "x", r"base.modle: unknown key \(misspelt\?\). Did you mean 'base.model'\? Every key of "
                                r"'base': docs/parameters.md\n"),
    ("ingest", "ingest.resolution", 0, r"ingest.resolution: Input should be greater than"),
    ("ingest", "ingest.output_format", "gif", r"ingest.output_format: Input should be 'png' or 'jpeg'"),
    ("ingest", "ingest.video.frames", [16, 24], r"ingest.video: Value error, frames \[16, 24\] are not frame_step x k "
     r"\+ 1 \(frame_step 8\), which the video VAE needs; use e.g. \[9, 17\]"),
    ("ingest", "ingest.video.decode_memory_mb", 64, r"ingest.video.decode_memory_mb: Input should be greater than or "
     r"equal to 256"),
    ("class_images", "class_images.num_images", -1, r"class_images.num_images: Input should be greater"),
    ("class_images", "class_images.resolution", 63, r"class_images.resolution: Input should be a multiple of 8"),
    ("class_images", "class_images.guidance_scale", "high",
     r"class_images.guidance_scale: Input should be a valid number"),
    ("train", "train.learning_rate", -1, r"train.learning_rate: Input should be greater than 0 \(got -1\)"),
    ("train", "train.max_train_steps", 0, r"train.max_train_steps: Input should be greater than"),
    ("train", "train.method", "magic", r"train.method: .*unknown method 'magic'; choose one of dreambooth"),
    ("train", "train.mixed_precision", "fp8", r"train.mixed_precision: Input should be"),
    ("train", "train.launch.num_processes", 0, r"train.launch.num_processes: Input should be greater"),
    ("export", "export.height", 63, r"export.height: Input should be a multiple of 8 \(got 63\)"),
    ("export", "export.compression.mode", "int3", r"export.compression.mode: Input should be 'none'"),
    ("export", "export.parity.guidance_scale", 1.0, r"export.parity.guidance_scale: Input should be greater than 1"),
    ("evaluate", "evaluate.images_per_prompt", 0, r"evaluate.images_per_prompt: Input should be greater"),
    ("evaluate", "evaluate.export_fidelity.max_prompts", 0,
     r"evaluate.export_fidelity.max_prompts: Input should be greater"),
    ("register", "register.primary_metric_goal", "up", r"register.primary_metric_goal: Input should be 'maximize'"),
]


def _set(data: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for part in parents:
        data = data[part]
    data[last] = value


def _run_cli(module: str, argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """`python -m <module> <argv>`, in this process (the same argument parsing and main)."""
    main = importlib.import_module(f"{module}.__main__").main
    old = sys.argv
    sys.argv = [module, *argv]
    try:
        with pytest.raises(SystemExit) as exit_:
            main()
    finally:
        sys.argv = old
    return int(exit_.value.code or 0), capsys.readouterr().err


def _written(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize(("stage", "key", "value", "error"), PARAMS, ids=[f"{r[1]}={r[2]!r}" for r in PARAMS])
def test_a_bad_params_yaml_value_stops_the_stage_before_anything(stage, key, value, error, workdir, capsys,
                                                                   isolated_mlflow) -> None:
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    _set(params, key, value)
    (workdir / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    before = (workdir / "params.yaml").read_bytes()
    code, err = _run_cli(f"tasks.{stage}", [*OUTPUTS[stage], "--params", "params.yaml"], capsys)
    assert code == 2 and "invalid parameters" in err
    assert re.search(error, err, re.S), err
    assert "Traceback" not in err
    assert (workdir / "params.yaml").read_bytes() == before
    assert _written(workdir) == {"params.yaml"}, "no output, report or partial folder"
    assert stage_runs(isolated_mlflow) == [], "no MLflow run was opened"


CLI = [
    # (stage, arguments, the error)
    ("train", ["--base", "models/base"], r"the following arguments are required: --data, --class-data, --out"),
    ("export", ["--model"], r"argument --model: expected one argument"),
    ("base", ["--out", "models/base", "--params", "missing.yaml"], r"missing.yaml not found: run from the "
                                                                    r"repository root or pass --params PATH"),
    ("ingest", [*OUTPUTS["ingest"], "--bogus", "1"], r"unrecognized arguments: --bogus 1"),
    ("class_images", ["--base", "models/base"], r"the following arguments are required: --out, --report"),
    ("evaluate", [*OUTPUTS["evaluate"], "--metrics"], r"argument --metrics: expected one argument"),
    ("register", OUTPUTS["register"], r"dvc.lock not found: run the pipeline first"),
]


@pytest.mark.parametrize(("stage", "argv", "error"), CLI, ids=[f"{r[0]} {' '.join(r[1])[:30]}" for r in CLI])
def test_bad_cli_arguments_stop_the_stage_before_anything(stage, argv, error, workdir, capsys, isolated_mlflow) -> None:
    (workdir / "params.yaml").write_bytes((REPO / "params.yaml").read_bytes())
    code, err = _run_cli(f"tasks.{stage}", argv, capsys)
    assert code == 2 and re.search(error, err, re.S), err
    assert (workdir / "params.yaml").read_bytes() == (REPO / "params.yaml").read_bytes()
    assert _written(workdir) == {"params.yaml"}
    assert stage_runs(isolated_mlflow) == []


def test_a_missing_input_folder_names_the_stage_to_run(workdir, capsys) -> None:
    """Inputs are checked before any work: the error names the stage to run; no output, no report
    and no partial folder (the stage's MLflow run is opened first and records the failure)."""
    (workdir / "params.yaml").write_bytes((REPO / "params.yaml").read_bytes())
    code, err = _run_cli("tasks.export", [*OUTPUTS["export"], "--params", "params.yaml"], capsys)
    assert code == 2 and "models/finetuned" in err and "dvc repro" in err, err
    assert _written(workdir) <= {"params.yaml", "models"} and not any((workdir / "models").iterdir())


OVERRIDES = [
    # (overrides, the error): each must leave params.yaml byte-identical
    ({"train.max_train_steps": -5}, r"train.max_train_steps: Input should be greater than or equal to 1 \(got -5\)"),
    ({"train.learning_rate": "fast"}, r"train.learning_rate: Input should be a valid number"),
    ({"export.height": 100}, r"export.height: Input should be a multiple of 8"),
    ({"train.max_train_step": 5}, r"override 'train.max_train_step': params.yaml has no key 'max_train_step'"),
    ({"train": {"seed": 1}}, r"override single values, one dotted key each"),
    ({"train..seed": 1}, r"must be a dotted params.yaml key"),
    ({"train.seed": 1, "evaluate.guidance_scale": 0.5}, r"evaluate.guidance_scale: .*greater than 1"),
]


@pytest.mark.parametrize(("overrides", "error"), OVERRIDES, ids=[str(r[0])[:40] for r in OVERRIDES])
def test_bad_flow_overrides_leave_params_yaml_as_it_was(overrides, error, tmp_path) -> None:
    from flows.params import validate_overrides
    from tasks.common.errors import UserError

    params = tmp_path / "params.yaml"
    params.write_bytes((REPO / "params.yaml").read_bytes())
    with pytest.raises(UserError, match=error):
        validate_overrides(params, overrides)
    assert params.read_bytes() == (REPO / "params.yaml").read_bytes()
    assert _written(tmp_path) == {"params.yaml"}, "no temporary file left beside it"


@pytest.mark.parametrize(("argv", "error"), [
    (["--set", "train.max_train_steps"], r"--set 'train.max_train_steps': expected KEY=VALUE"),
    # through the Prefect flow itself (a temporary Prefect server: about 10 s)
    (["--set", "train.max_train_steps=-1"], r"error: .*train.max_train_steps: Input should be greater than or equal"),
])
def test_the_flow_cli_refuses_bad_sets_before_running(argv, error, tmp_path, monkeypatch, capsys,
                                                      isolated_mlflow) -> None:
    """`python -m flows.finetune --set ...` against a copy of params.yaml and dvc.yaml."""
    import flows.finetune as finetune

    for name in ("params.yaml", "dvc.yaml"):
        (tmp_path / name).write_bytes((REPO / name).read_bytes())
    monkeypatch.setattr(finetune, "REPO", tmp_path)
    monkeypatch.setattr(sys, "argv", ["flows.finetune", *argv])
    with pytest.raises(SystemExit) as exit_:
        finetune.main()
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and re.search(error, err, re.S), err
    assert (tmp_path / "params.yaml").read_bytes() == (REPO / "params.yaml").read_bytes()
    assert _written(tmp_path) <= {"params.yaml", "dvc.yaml", ".dvc", ".dvc/tmp", ".dvc/tmp/finetune-flow.lock"}
    assert stage_runs(isolated_mlflow) == [], "no MLflow run was opened"
