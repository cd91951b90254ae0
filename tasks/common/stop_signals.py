"""How a request to stop (SIGTERM, Ctrl-C's SIGINT) travels from the launcher to every rank.

Training answers the first SIGTERM or SIGINT by finishing its step and saving a checkpoint
(`tasks.train.interrupts`), which takes seconds to minutes. The launchers in between must pass the
request on without killing the ranks first:

- Open MPI's `mpirun` answers SIGTERM and SIGINT by killing the job: SIGTERM to the ranks, then
  SIGKILL once `odls_base_sigkill_timeout` (1 s) has passed. It passes SIGUSR1 and SIGUSR2 on to
  every rank unchanged. So the launcher sends the first request on as one of those (`OPEN_MPI`),
  and a launched rank reads it back as the signal it stands for (`asked_for`).
- a later signal goes on as itself: "send it again to stop at once".
- the launcher runs in a process group of its own, so a terminal's Ctrl-C (SIGINT to the whole
  foreground group) reaches the ranks once, through this process, instead of also reaching them
  and `mpirun` directly (which would count as the second signal, or kill them a second later).
  Requests go to that whole group: Open MPI's ranks and torchrun's workers each run in a group of
  their own and hear it from their launcher, while the one worker of a single-process `accelerate
  launch` (which passes nothing on) is in the group and hears it directly.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

#: Open MPI: what the launcher sends in place of the first request
OPEN_MPI = {signal.SIGTERM: signal.SIGUSR2, signal.SIGINT: signal.SIGUSR1}
#: the signals a rank started by our launcher reads as a request, and what each stands for
RELAYED = {sent: asked for asked, sent in OPEN_MPI.items()}
REQUESTS = (signal.SIGTERM, signal.SIGINT)
WORKER_ENV = "FINETUNE_LAUNCHED"  # set in every launched process (tasks.common.launch): it never launches again


def relay(proc: subprocess.Popen, sent_as: dict[int, int]) -> list[int]:
    """Pass SIGTERM and SIGINT received here on to the process group `proc` leads (the launcher: the
    first one as `sent_as` says, later ones as themselves). Returns the signals received, as they come."""
    seen: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        try:
            os.killpg(proc.pid, signum if seen else sent_as.get(signum, signum))
        except ProcessLookupError:  # already gone
            pass
        seen.append(signum)

    for s in REQUESTS:
        signal.signal(s, forward)
    return seen


def wait_for_group(pgid: int) -> None:
    """Return once no process of group `pgid` runs any more: a worker whose launcher exits at the
    request (a single-process `accelerate launch`) may still be saving. A second signal stops it."""
    while _group_runs(pgid):
        time.sleep(0.2)


def _group_runs(pgid: int) -> bool:
    """True while a process of the group runs (a zombie its parent never reaps does not count)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _ppid, group = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        if int(group) == pgid and state != "Z":
            return True
    return False


def watched() -> tuple[int, ...]:
    """The signals that ask this process to stop: SIGTERM and SIGINT, and in a rank our launcher
    started, the ones it relays them as."""
    return REQUESTS + (tuple(RELAYED) if os.environ.get(WORKER_ENV) else ())


def asked_for(signum: int) -> int:
    """The request a received signal stands for (SIGUSR2 from Open MPI's launcher: SIGTERM)."""
    return RELAYED.get(signum, signum) if os.environ.get(WORKER_ENV) else signum
