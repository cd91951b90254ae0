"""Run one DVC stage with the real `dvc repro --single-item` and report what DVC did; and every
other `dvc` command flows/ runs (`run_dvc`, `dvc_status`), in the same environment.

Kept free of Prefect so it can be tested on a throw-away DVC project; flows/finetune.py wraps it
in a Prefect task. DVC decides whether the stage runs: it compares the stage's deps, params and
outs with dvc.lock, and we only read its verdict from its own log lines.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from tasks.common.credentials import stage_environ
from tasks.common.errors import UserError

#: ran: DVC executed the command. skipped: nothing changed since dvc.lock.
#: restored: DVC found this exact run in its run-cache and checked the outputs out instead (only
#: without a remote: a pulling run ignores the run-cache, `repro(pull=True)`).
#: pulled (`repro(..., pull=True)`): nothing changed but the outputs were missing here, and DVC
#: pulled them from the remote.
Status = Literal["ran", "skipped", "restored", "pulled"]

_RAN = re.compile(r"Running stage '(?P<stage>[^']+)'")
_SKIPPED = re.compile(r"Stage '(?P<stage>[^']+)' didn't change, skipping")
_RESTORED = re.compile(r"Stage '(?P<stage>[^']+)' is cached - skipping run")
#: `dvc repro --pull` on a stage whose outputs are missing; when the pull fails ("Unable to pull
#: data"), DVC goes on to restore or run the stage, and that later verdict counts.
_PULLED = re.compile(r"Pulling data for stage: '(?P<stage>[^']+)'")
_VERDICTS = ((_RAN, "ran"), (_RESTORED, "restored"), (_PULLED, "pulled"), (_SKIPPED, "skipped"))
#: DVC's error when the stage's command died: "failed to run: <cmd>, exited with -9". The command
#: is DVC's child, so DVC itself exits 255; the signal is only in this line. When the command runs
#: under a shell that does not exec it, the shell reports 128+N instead (137 SIGKILL, 143 SIGTERM,
#: 130 SIGINT), so both spellings are read.
_EXITED = re.compile(r"exited with (?P<code>-?\d+)\s*$")

#: Signals after which a rerun can succeed: SIGKILL (the OOM killer, `kill -9`, a container
#: limit) and SIGTERM (a worker or node shutting down). SIGINT is a person's Ctrl-C: not retried.
RETRYABLE_SIGNALS = (signal.SIGKILL, signal.SIGTERM)

_SIGNAL_NUMBERS = frozenset(int(s) for s in signal.valid_signals())

#: DVC's closing advice after a stage that wrote dvc.lock ("To track the changes with git, run: git
#: add dvc.lock", "To enable auto staging, run: dvc config core.autostage true"): the flow runs one
#: `dvc repro` per stage, so it would come after every stage; the flow gives it once at its end
#: (`lock_hint`), the error tail keeps it.
#: DVC's "Use `dvc push`" after each stage is left out too: the flow pushes itself where a remote is
#: set (flows/remote.py). DVC also warns of every empty output; ingest's list of rejected files is
#: empty when nothing was rejected, which is no news.
_GIT_HINT = re.compile(r"^(To track the changes with git, run:|To enable auto staging, run:|\s*git add |"
                       r"\s*dvc config core\.autostage true$|Use `dvc push` to send your updates to remote storage\.$|"
                       r"WARNING: '[^']*_rejected\.jsonl' is empty\.$)")

#: Lines of DVC's output quoted in the error when a stage fails.
ERROR_TAIL_LINES = 40
#: Characters of DVC's output quoted when another dvc command (status, pull, push...) fails.
TAIL_CHARS = 2000
#: `dvc status` verdicts that only say "not here": what a pull brings back.
MISSING = frozenset({"deleted", "not in cache"})


@dataclass(frozen=True)
class StageResult:
    stage: str
    status: Status
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class StageFailed(RuntimeError):
    """A stage's command (or DVC itself) failed; the message names the stage and quotes DVC."""

    def __init__(self, stage: str, returncode: int, tail: list[str]) -> None:
        self.stage = stage
        self.returncode = returncode
        self.tail = tail
        quoted = "\n".join(f"  | {line}" for line in tail) or "  | (no output)"
        why = (" because another `dvc repro` in this workspace holds DVC's lock on its files "
               "(wait for it to finish, or use a separate clone)" if self.busy else "")
        super().__init__(
            f"stage '{stage}' failed{why} (dvc repro exit code {returncode}). "
            f"Last lines of its output:\n{quoted}"
        )

    @property
    def busy(self) -> bool:
        """DVC refused to start: another DVC process holds the lock on a dep or output."""
        return any("it is being blocked by" in line for line in self.tail)

    @property
    def signal(self) -> int | None:
        """The signal that killed the stage's command (or DVC itself), if one did."""
        codes = [self.returncode]
        for line in self.tail:
            m = _EXITED.search(line)
            if m:
                codes.append(int(m.group("code")))
        for code in codes:
            if code < 0:
                return -code
            if code - 128 in _SIGNAL_NUMBERS:
                return code - 128
        return None

    @property
    def killed(self) -> bool:
        """True when the stage was killed by SIGKILL or SIGTERM (OOM killer, worker shutdown).

        The flow's retries key on this: a killed stage may succeed when run again (resuming from
        its checkpoint); a config or data error (exit code 2 from a stage's UserError) never will.
        """
        return self.signal in RETRYABLE_SIGNALS


def classify(stage: str, lines: list[str]) -> Status:
    """What DVC did with `stage`, from its log lines: the first of ran, restored, pulled,
    skipped that they show (a failed pull is followed by a restore or a run)."""
    for pattern, status in _VERDICTS:
        for line in lines:
            m = pattern.search(line)
            if m and m.group("stage") == stage:
                return status  # type: ignore[return-value]
    raise RuntimeError(
        f"dvc repro printed no verdict for stage '{stage}'; output was:\n" + "\n".join(lines)
    )


def stage_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for `dvc repro`: ours, with only the credentials of the `"dvc"` row of
    tasks/common/credentials.py (the DVC remote's keys and what its stages may get; never Prefect's
    auth string), plus `extra`, with this interpreter's bin dir first. Each stage then keeps only
    its own row (`confine`, the first call of every stage).

    dvc.yaml commands say `python -m tasks.<stage>`; putting the running venv's bin first on PATH
    makes that `python` the venv's even when the caller never activated it (Prefect worker, make).
    """
    env = stage_environ("dvc")
    bindir = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([bindir, env.get("PATH", "")]).rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"  # stream stage logs as they happen, not at exit
    env.update(extra or {})
    return env


def dvc_argv(*args: str) -> list[str]:
    """`dvc <args>` as run by this interpreter (the venv's DVC, whatever PATH holds)."""
    return [sys.executable, "-m", "dvc", *args]


def output_tail(proc: subprocess.CompletedProcess[str]) -> str:
    """The end of a finished dvc command's output, for an error message."""
    return (proc.stdout + proc.stderr).strip()[-TAIL_CHARS:]


def run_dvc(root: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """`dvc <args>` in `root` with `stage_env()`, its output captured. `check`: a UserError naming
    the command and quoting DVC's output when it fails (else the caller reads `returncode`)."""
    proc = subprocess.run(dvc_argv(*args), cwd=root, env=stage_env(), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise UserError(f"`dvc {' '.join(args)}` failed in {root} (exit {proc.returncode}):\n{output_tail(proc)}")
    return proc


def dvc_status(root: Path, targets: tuple[str, ...] = ()) -> dict[str, Any]:
    """`dvc status --json [targets]` in `root`: {} when every stage matches dvc.lock."""
    text = run_dvc(root, "status", "--json", *targets).stdout.strip()
    return json.loads(text[text.index("{"):]) if "{" in text else {}


def repro(
    stage: str,
    root: Path,
    env: Mapping[str, str] | None = None,
    log: Callable[[str], None] = print,
    pull: bool = False,
) -> StageResult:
    """Run `dvc repro --single-item <stage>` in `root`, streaming each output line to `log`.

    pull: `--pull --no-run-cache`, with a default DVC remote (flows/remote.py): an unchanged stage
    whose outputs are missing here gets them from the remote (checked against their md5s: the
    flow requires the remote's `verify`); a changed one pulls its missing deps and runs. The
    remote's run-cache is never trusted: any holder of the remote's keys could push an entry
    that restores a stage, the evaluation gate included, without running it (infra/README.md,
    "Who can write where")."""
    pulling = ["--pull", "--no-run-cache"] if pull else []
    cmd = dvc_argv("repro", "--single-item", *pulling, stage)
    start = time.monotonic()
    seen: list[str] = []
    tail: deque[str] = deque(maxlen=ERROR_TAIL_LINES)
    with subprocess.Popen(
        cmd,
        cwd=root,
        env=stage_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        bufsize=1,
    ) as proc:
        assert proc.stdout is not None
        for raw in proc.stdout:
            # Progress bars redraw with carriage returns: keep only the last state of a line.
            line = raw.rstrip("\n").split("\r")[-1].rstrip()
            if not line:
                continue
            if not _GIT_HINT.match(line):
                log(line)
            tail.append(line)
            if any(pattern.search(line) for pattern, _ in _VERDICTS):
                seen.append(line)
        returncode = proc.wait()
    if returncode != 0:
        raise StageFailed(stage, returncode, list(tail))
    seconds = round(time.monotonic() - start, 2)
    return StageResult(stage=stage, status=classify(stage, seen), seconds=seconds)


def lock_hint(root: Path) -> str | None:
    """DVC's advice, once: when git sees dvc.lock as new or changed in `root`, what to do with it
    (docs/pipeline.md, "dvc.lock"); None when git has it as it is, or `root` is not a git repository."""
    proc = subprocess.run(["git", "status", "--porcelain", "--", "dvc.lock"], cwd=root, capture_output=True,
                          text=True)
    if proc.returncode != 0 or not proc.stdout.strip():
        return None
    return ("dvc.lock records what this run used and made (new or changed for git): commit it "
            "(git add dvc.lock) to share the run through git, as the team stack's machines read it; "
            "docs/pipeline.md, \"dvc.lock\"")
