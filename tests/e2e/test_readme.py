"""The README's commands as written, in the order a reader meets them, in a fresh copy of the
project after `make demo`: each fence marked `<!-- readme-test: run -->` (tests/readme_blocks.py)
runs whole in bash (python fences in `.venv/bin/python`), with the environment a user's shell has
(no tracking URI, no Prefect API), the project's `.venv` linked in as `make install` left it."""
from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from tests.e2e_util import VENV_BIN, copy_repo, free_port, stop_process_group
from tests.readme_blocks import Block, blocks

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(2400)]

#: what the user's shell has not: the suite's own tracking store, Prefect server, sys.path
NOT_IN_A_USERS_SHELL = ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_ID", "MLFLOW_EXPERIMENT_NAME",
                        "PREFECT_API_URL", "PYTHONPATH", "SD_PIPELINE_LOG_FILE", "LOG_LEVEL")


def run_block(block: Block, root: Path, env: dict[str, str]) -> tuple[subprocess.CompletedProcess[str], float]:
    """One fence, whole, in its own session (what it leaves running is stopped after it)."""
    if block.lang == "python":
        (root / "readme_block.py").write_text(block.text)
        command = [".venv/bin/python", "readme_block.py"]
    else:
        command = ["bash", "-e", "-c", block.text]
    start = time.monotonic()
    proc = subprocess.Popen(command, cwd=root, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=1800)
    finally:
        try:
            stop_process_group(proc, timeout=30)
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(command, proc.returncode, out, ""), time.monotonic() - start


@pytest.fixture(scope="module")
def walkthrough(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[Block, subprocess.CompletedProcess, float]]:
    root = copy_repo(tmp_path_factory.mktemp("readme"))
    (root / ".venv").symlink_to(VENV_BIN.parent)
    env = {k: v for k, v in os.environ.items() if k not in NOT_IN_A_USERS_SHELL}
    env["PORT"] = str(free_port())  # the Makefile's serve-model port, 5001 unless set
    stale = subprocess.run(["make", "-q", ".venv/.installed"], cwd=root, env=env)
    if stale.returncode != 0:
        pytest.fail("make would reinstall the linked .venv (its stamp is older than the locks): run make install")
    done = []
    for block in (b for b in blocks() if b.runs):
        proc, seconds = run_block(block, root, env)
        done.append((block, proc, seconds))
        if proc.returncode != 0:
            break
    return done


def test_every_marked_command_runs_as_written_in_order(walkthrough) -> None:
    ran = [b for b in blocks() if b.runs]
    for block, proc, seconds in walkthrough:
        where = f"README.md:{block.line} failed after {seconds:.0f} s:\n{block.text}"
        assert proc.returncode == 0, f"{where}\n{proc.stdout[-6000:]}"
    assert len(walkthrough) == len(ran)
    (demo, status, load, serve) = (proc.stdout for _, proc, _ in walkthrough)
    assert "pipeline took" in demo and "Registered model   sd-dreambooth (latest v1" in demo, demo[-3000:]
    # only the data folder's manifest, rewritten by every `dvc repro` (tasks/ingest/manifest.py)
    assert status.startswith("data_manifest:\n\talways changed\n"), status
    assert status.count("didn't change, skipping") == 6 and status.count("Running stage") == 1, status
    assert "Traceback" not in load, load[-3000:]
    answer, _ = json.JSONDecoder().raw_decode(serve[serve.index('{"predictions"'):])  # curl ends no line
    assert len(answer["predictions"]) == 1 and answer["predictions"][0]["image"], serve[-2000:]


#: the project's own lines: its loggers' records (relayed by Prefect's task runs) and the end
#: summary's WARNING row
PROJECT_LINE = re.compile(r"(\d\d:\d\d:\d\d (DEBUG|INFO|WARNING|ERROR) (tasks|flows|__main__)[.:]"
                          r"|^  WARNING {12}uncalibrated)")


def test_the_demo_terminal_has_no_third_party_warnings_or_bars(walkthrough) -> None:
    demo = walkthrough[0][1].stdout
    warnings = [ln for ln in demo.splitlines() if re.search(r"warn", ln, re.I) and not PROJECT_LINE.search(ln)]
    assert warnings == [], "\n".join(warnings)
    bars = [ln for ln in demo.splitlines() if "it/s]" in ln or "s/it]" in ln]
    assert bars == [], "\n".join(bars[:5])
    assert demo.count("git add dvc.lock") <= 1 and "dvc push" not in demo
