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
"""
from __future__ import annotations

import os
import signal
import subprocess

#: Open MPI: what the launcher sends in place of the first request
OPEN_MPI = {signal.SIGTERM: signal.SIGUSR2, signal.SIGINT: signal.SIGUSR1}
#: the signals a rank started by our launcher reads as a request, and what each stands for
RELAYED = {sent: asked for asked, sent in OPEN_MPI.items()}
REQUESTS = (signal.SIGTERM, signal.SIGINT)
WORKER_ENV = "FINETUNE_LAUNCHED"  # set in every launched process (tasks.common.launch): it never launches again


def relay(proc: subprocess.Popen, sent_as: dict[int, int]) -> list[int]:
    """Pass SIGTERM and SIGINT received here on to `proc` (the launcher: the first one as
    `sent_as` says, later ones as themselves). Returns the list of signals received, filled as they come."""
    seen: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        proc.send_signal(signum if seen else sent_as.get(signum, signum))
        seen.append(signum)

    for s in REQUESTS:
        signal.signal(s, forward)
    return seen


def watched() -> tuple[int, ...]:
    """The signals that ask this process to stop: SIGTERM and SIGINT, and in a rank our launcher
    started, the ones it relays them as."""
    return REQUESTS + (tuple(RELAYED) if os.environ.get(WORKER_ENV) else ())


def asked_for(signum: int) -> int:
    """The request a received signal stands for (SIGUSR2 from Open MPI's launcher: SIGTERM)."""
    return RELAYED.get(signum, signum) if os.environ.get(WORKER_ENV) else signum
