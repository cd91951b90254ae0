"""The stage runner on a throw-away DVC project, with the real `dvc repro --single-item`."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from flows.dvc_stage import StageFailed, classify, lock_hint, repro

MAKE = "import sys, pathlib; pathlib.Path('out.txt').write_text(sys.prefix + open('in.txt').read())"
BROKEN = "import sys; print('reading params'); sys.exit('error: params.yaml: train.seed: bad value')"
# A shell that starts a job in the background makes it ignore SIGINT, and an ignored signal stays
# ignored across exec: the stage puts back the default action first (SIGKILL has no other).
KILLED = ("import os, signal; print('step 3'); s = signal.SIG{}; "
          "s == signal.SIGKILL or signal.signal(s, signal.SIG_DFL); os.kill(os.getpid(), s); print('unreachable')")
# Waits for a file named `go` (iter(f, True) calls f until it returns True), then writes its output.
SLOW = ("import os, time; [time.sleep(0.2) for _ in iter(lambda: os.path.exists('go'), True)]; "
        "open('slow.txt', 'w').write('done')")
DVC_YAML = {
    "stages": {
        "make": {"cmd": f'python -c "{MAKE}"', "deps": ["in.txt"], "outs": ["out.txt"]},
        "broken": {"cmd": f'python -c "{BROKEN}"'},
        "slow": {"cmd": f'python -c "{SLOW}"', "outs": ["slow.txt"]},
        "oom": {"cmd": f'python -c "{KILLED.format("KILL")}"'},
        "drained": {"cmd": f'python -c "{KILLED.format("TERM")}"'},
        "interrupted": {"cmd": f'python -c "{KILLED.format("INT")}"'},
    }
}


@pytest.fixture
def project(tmp_path: Path) -> Path:
    subprocess.run([sys.executable, "-m", "dvc", "init", "--no-scm", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump(DVC_YAML, width=1000))
    (tmp_path / "in.txt").write_text("one")
    return tmp_path


def test_ran_then_skipped_then_restored_from_run_cache(project: Path) -> None:
    lines: list[str] = []
    first = repro("make", project, log=lines.append)
    assert first.status == "ran"
    assert "Running stage 'make':" in lines
    # `python` in dvc.yaml is this venv's interpreter, even though PATH was not set up for it.
    assert (project / "out.txt").read_text() == sys.prefix + "one"

    assert repro("make", project).status == "skipped"

    (project / "in.txt").write_text("two")
    assert repro("make", project).status == "ran"
    (project / "in.txt").write_text("one")  # back to a state DVC has seen: its run-cache has it
    assert repro("make", project).status == "restored"
    assert (project / "out.txt").read_text() == sys.prefix + "one"


def test_failure_names_the_stage_and_quotes_dvc(project: Path) -> None:
    with pytest.raises(StageFailed) as err:
        repro("broken", project)
    message = str(err.value)
    assert message.startswith("stage 'broken' failed")
    assert "error: params.yaml: train.seed: bad value" in message  # the stage's own error
    assert "reading params" in message
    assert err.value.returncode != 0 and not err.value.killed


@pytest.mark.parametrize(("stage", "signal", "killed"),
                         [("oom", 9, True), ("drained", 15, True), ("interrupted", 2, False)])
def test_a_stage_killed_by_a_signal_is_recognised(project: Path, stage: str, signal: int,
                                                  killed: bool) -> None:
    """The real case: the stage's process dies, DVC survives and exits 255; the signal is only in
    DVC's error line. SIGKILL/SIGTERM may succeed on a rerun; Ctrl-C (SIGINT) is a person's."""
    with pytest.raises(StageFailed) as err:
        repro(stage, project)
    assert err.value.returncode == 255  # DVC's own exit code says nothing about the signal
    assert err.value.signal == signal and err.value.killed is killed


@pytest.mark.parametrize(("line", "signal", "killed"),
                         [("exited with -9", 9, True), ("exited with 137", 9, True),
                          ("exited with 143", 15, True), ("exited with 130", 2, False),
                          ("exited with 1", None, False), ("exited with 2", None, False)])
def test_signal_read_from_either_spelling(line: str, signal: int | None, killed: bool) -> None:
    """A command DVC runs directly dies with -N; one run under a shell that does not exec it
    comes back as the shell's 128+N. Plain exit codes are not signals."""
    err = StageFailed("s", 255, [f"ERROR: failed to reproduce 's': failed to run: x, {line}"])
    assert err.signal == signal and err.killed is killed


def test_a_second_repro_of_a_running_stage_is_refused_by_dvcs_lock(project: Path) -> None:
    import threading

    first_lines: list[str] = []
    results: list[object] = []
    first = threading.Thread(target=lambda: results.append(repro("slow", project,
                                                                 log=first_lines.append)))
    first.start()
    try:
        for _ in range(600):
            if "Running stage 'slow':" in first_lines:
                break
            time.sleep(0.2)
        with pytest.raises(StageFailed) as err:
            repro("slow", project)
        assert err.value.busy and not err.value.killed  # refused, and not retried
        assert "another `dvc repro` in this workspace holds DVC's lock" in str(err.value)
        assert "slow.txt' is busy, it is being blocked by" in str(err.value)
    finally:
        (project / "go").touch()
        first.join(timeout=300)
    assert results and results[0].status == "ran"  # the first run was not disturbed
    assert (project / "slow.txt").read_text() == "done"


def test_killed_stage_counts_as_killed() -> None:
    assert StageFailed("train", -9, []).killed  # DVC itself killed
    assert StageFailed("train", 137, []).killed  # a shell's 128 + 9
    assert StageFailed("train", 255, ["ERROR: failed to reproduce 'train': failed to run: "
                                      "python -m tasks.train, exited with -15"]).killed
    assert not StageFailed("train", 2, []).killed
    assert not StageFailed("train", 255, ["ERROR: ..., exited with 2"]).killed


def test_classify_reads_only_the_named_stage() -> None:
    lines = ["Stage 'base' didn't change, skipping", "Running stage 'ingest':"]
    assert classify("base", lines) == "skipped"
    assert classify("ingest", lines) == "ran"
    with pytest.raises(RuntimeError, match="no verdict for stage 'train'"):
        classify("train", lines)


def test_classify_a_pull_and_what_follows_a_failed_one() -> None:
    """`dvc repro --pull`'s lines (DVC 3.67): a pull that worked is the verdict; after one that
    failed, DVC restores the stage from its run-cache or runs it, and that counts."""
    pulled = ["Pulling data for stage: 'train'", "Data and pipelines are up to date."]
    assert classify("train", pulled) == "pulled"
    failed = ["Pulling data for stage: 'train'", "Unable to pull data for stage: 'train'"]
    assert classify("train", [*failed, "Running stage 'train':"]) == "ran"
    assert classify("train", [*failed, "Stage 'train' is cached - skipping run, checking out "
                                       "outputs"]) == "restored"


def test_dvcs_git_hints_are_not_repeated_after_each_stage(tmp_path: Path) -> None:
    """In a git repository DVC ends each repro that wrote dvc.lock with "git add dvc.lock" advice: the
    stage runner logs everything else, and the flow gives the advice once (`lock_hint`)."""
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"make": DVC_YAML["stages"]["make"]}}, width=1000))
    (tmp_path / "in.txt").write_text("one")
    raw = subprocess.run([sys.executable, "-m", "dvc", "repro", "--single-item", "make"], cwd=tmp_path,
                         capture_output=True, text=True, check=True)
    assert "git add" in raw.stdout + raw.stderr, "DVC gives the advice the runner leaves out"
    (tmp_path / "in.txt").write_text("two")
    logged: list[str] = []
    result = repro("make", tmp_path, log=logged.append)
    assert result.status == "ran" and any("Running stage 'make'" in line for line in logged)
    assert not [line for line in logged if "git add" in line or "autostage" in line], logged
    assert "git add dvc.lock" in lock_hint(tmp_path)  # said once, by the flow, while git sees it new
    subprocess.run(["git", "add", "-A"], cwd=tmp_path, check=True)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "run"], cwd=tmp_path,
                   check=True)
    assert lock_hint(tmp_path) is None
