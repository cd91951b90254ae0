"""A stage's terminal shows the project's lines; other libraries' go to .cache/logs/<stage>.log."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.common.errors import UserError, log_level
from tests.conftest import REPO

#: the project's terminal lines: `HH:MM:SS LEVEL tasks.x: ...` or a UserError's `error: ...`
PROJECT_LINE = re.compile(r"^(\d\d:\d\d:\d\d (DEBUG|INFO|WARNING|ERROR|CRITICAL) (tasks|flows|__main__)[.:]|error: )")

#: a stage-like program: libraries that install their own terminal handlers after main_guard ran
#: (a StreamHandler with propagation off, as transformers and MLflow do; a plain Handler writing to
#: stderr, as torch's `_StderrHandler`), a warning, a root-propagating library, an error
PROGRAM = '''
import logging, sys, warnings
from tasks.common.errors import main_guard

class _StderrHandler(logging.Handler):
    def emit(self, record):
        print("TORCHLIKE " + record.getMessage(), file=sys.stderr)

@main_guard
def main():
    logging.getLogger("tasks.demo").info("project line")
    lib = logging.getLogger("libwithhandler")
    lib.addHandler(logging.StreamHandler(sys.stdout))
    lib.propagate = False
    lib.warning("LIB own handler")
    torchlike = logging.getLogger("torchlike")
    torchlike.handlers = [_StderrHandler()]
    torchlike.propagate = False
    torchlike.warning("TORCH own handler")
    logging.getLogger("plainlib").warning("PLAIN to root")
    warnings.warn("WARN python warning")
    logging.getLogger("plainlib").error("ERR still shown")

main()
'''


def run(cwd: Path, *args: str, level: str | None = None, timeout: int = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("LOG_LEVEL", None)
    env.pop("SD_PIPELINE_LOG_FILE", None)
    if level:
        env["LOG_LEVEL"] = level
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def foreign(proc: subprocess.CompletedProcess[str]) -> list[str]:
    """Terminal lines that are not the project's."""
    return [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip() and not PROJECT_LINE.match(ln)]


@pytest.mark.quick
def test_late_library_handlers_go_to_the_log_file(tmp_path: Path) -> None:
    (tmp_path / "prog.py").write_text(PROGRAM)
    proc = run(tmp_path, "prog.py")
    assert proc.returncode == 0, proc.stderr
    assert [ln for ln in foreign(proc) if " ERROR plainlib: ERR still shown" not in ln] == [], proc.stderr
    terminal = proc.stdout + proc.stderr
    assert "project line" in terminal and "ERR still shown" in terminal, "errors from anyone show"
    assert "go to .cache/logs/prog.log" in terminal
    log = (tmp_path / ".cache/logs/prog.log").read_text()
    for line in ("WARNING libwithhandler: LIB own handler", "WARNING torchlike: TORCH own handler",
                 "WARNING plainlib: PLAIN to root", "WARNING py.warnings: "):
        assert log.count(line) == 1, (line, log)
    assert "UserWarning: WARN python warning" in log
    assert log.startswith("==== ")

    run(tmp_path, "prog.py")
    assert (tmp_path / ".cache/logs/prog.log").read_text().count("==== ") == 2, "appended, a header per run"


#: a stage importing diffusers and transformers after it started, as stages do, then drawing the
#: bars they draw while loading a pipeline; MLflow's artifact downloads read the environment
BARS = '''
import os
from tasks.common.errors import main_guard

@main_guard
def main():
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging
    for lib in (diffusers_logging, transformers_logging):
        for _ in lib.tqdm(range(3), desc=f"BAR {lib.__name__}"):
            pass
    print("mlflow bars", os.environ.get("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "on"))

main()
'''


def test_libraries_imported_late_draw_no_progress_bars(tmp_path: Path) -> None:
    (tmp_path / "bars.py").write_text(BARS)
    proc = run(tmp_path, "bars.py", timeout=120)
    assert proc.returncode == 0, proc.stderr
    terminal = proc.stdout + proc.stderr
    assert "BAR " not in terminal and "mlflow bars false" in terminal, terminal
    loud = run(tmp_path, "bars.py", level="DEBUG", timeout=120)
    assert "BAR diffusers.utils.logging" in loud.stderr and "mlflow bars on" in loud.stdout


@pytest.mark.quick
def test_debug_shows_everything_on_the_terminal(tmp_path: Path) -> None:
    (tmp_path / "prog.py").write_text(PROGRAM)
    proc = run(tmp_path, "prog.py", level="debug")
    terminal = proc.stdout + proc.stderr
    for line in ("LIB own handler", "TORCH own handler", "PLAIN to root", "WARN python warning"):
        assert line in terminal, terminal
    assert not (tmp_path / ".cache/logs").exists()


@pytest.mark.quick
def test_bad_log_level_names_the_levels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOG_LEVEL", "loud")
    with pytest.raises(UserError, match="LOG_LEVEL='loud' is not a level: use one of DEBUG, INFO"):
        log_level()


def test_base_stage_terminal_has_only_the_project_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    args = ("-m", "tasks.base", "--out", "models/base")
    quiet_dir, loud_dir = tmp_path / "quiet", tmp_path / "loud"  # new MLflow stores: MLflow logs their creation
    for d in (quiet_dir, loud_dir):
        d.mkdir()
        shutil.copy(REPO / "params.yaml", d / "params.yaml")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{quiet_dir / 'mlflow.db'}")
    proc = run(quiet_dir, *args, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert foreign(proc) == [], proc.stdout + proc.stderr
    log = (quiet_dir / ".cache/logs/base.log").read_text()
    for line in ("INFO mlflow.store.db.utils: Creating initial MLflow database tables",
                 "WARNING torch.utils._pytree:", "requires torchvision (not installed)",
                 "WARNING bitsandbytes."):
        assert line in log, (line, log)

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{loud_dir / 'mlflow.db'}")
    loud = run(loud_dir, *args, level="DEBUG", timeout=300)
    assert loud.returncode == 0, loud.stderr
    terminal = loud.stdout + loud.stderr
    for line in ("Creating initial MLflow database tables", "is an Enum subclass",
                 "requires torchvision (not installed)", "Failed to load CPU gemm_4bit_forward"):
        assert line in terminal, (line, terminal[-3000:])
