"""One SIGKILL of one piece of the stack, and its restart as compose's `restart` policy would.

- stage: the running `python -m tasks.<stage>` process alone (the OOM killer's choice); nothing
  is restarted: the flow's retry (flows/finetune.py, STAGE_RETRIES) is the recovery.
- worker: the worker container, i.e. `python -m flows.serve --attach` with every descendant (the
  Prefect worker, the flow run, its stage); restarted, which marks the orphaned run Crashed.
- mlflow: the MLflow server's process group; restarted on the same port and database.
- postgres: the postmaster and its backends; restarted on the same data directory.
- prefect: the Prefect server's process group; restarted on the same port and database.
- registration: the worker, at one point of the registration drawn from hooks/sitecustomize.py's
  POINTS (the flow waits there for the kill), then restarted as for `worker`.
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

import psutil

from benchmarks.chaos.stack import Stack, kill_tree, postmaster

TARGETS = ("stage", "worker", "mlflow", "postgres", "prefect", "registration")
#: compose restarts a dead container at once; its start takes what it takes.
RESTART_DELAY_S = 2.0


@dataclass
class Kill:
    target: str
    what: str  # the process killed, or why nothing was
    at: float  # time.monotonic() of the kill (0: none)
    restarted_s: float = 0.0  # kill -> the piece answering again


def kill(stack: Stack, target: str) -> Kill | None:
    """Kill `target` now; None when there is nothing of it to kill (no stage running)."""
    killer = {"stage": _kill_stage, "worker": _kill_worker, "mlflow": _kill_mlflow,
              "postgres": _kill_postgres, "prefect": _kill_prefect, "registration": _kill_registering}[target]
    return killer(stack)


def _kill_stage(stack: Stack) -> Kill | None:
    procs = stack.stage_processes()
    if not procs:
        return None
    proc = procs[0]
    what = " ".join(proc.cmdline()[1:4])
    try:
        proc.send_signal(signal.SIGKILL)
    except psutil.NoSuchProcess:
        return None
    return Kill("stage", what, time.monotonic())


def _kill_worker(stack: Stack) -> Kill:
    stages = [" ".join(p.cmdline()[1:3]) for p in stack.stage_processes()]
    kill_tree(psutil.Process(stack.worker.pid))
    at = time.monotonic()
    stack.worker.wait()
    time.sleep(RESTART_DELAY_S)
    stack.start_worker()
    what = "flows.serve --attach" + (f" (in {stages[0]})" if stages else "")
    return Kill("worker", what, at, time.monotonic() - at)


def _kill_registering(stack: Stack) -> Kill | None:
    """The worker, once its flow waits at the armed point of the registration (None: not yet)."""
    hit = stack.window_dir / "hit"
    if not hit.is_file():
        return None
    point = hit.read_text().split()[0]
    done = _kill_worker(stack)
    hit.unlink()
    (stack.window_dir / "armed").unlink(missing_ok=True)
    return Kill("registration", f"flows.serve --attach (registering: {point})", done.at, done.restarted_s)


def _kill_prefect(stack: Stack) -> Kill:
    os.killpg(stack.prefect.pid, signal.SIGKILL)
    at = time.monotonic()
    stack.prefect.wait()
    time.sleep(RESTART_DELAY_S)
    stack.start_prefect()
    return Kill("prefect", f"prefect server pid {stack.prefect.pid}", at, time.monotonic() - at)


def _kill_mlflow(stack: Stack) -> Kill:
    os.killpg(stack.mlflow.pid, signal.SIGKILL)
    at = time.monotonic()
    stack.mlflow.wait()
    time.sleep(RESTART_DELAY_S)
    stack.start_mlflow(bootstrap=False)  # restarted on the same databases
    return Kill("mlflow", f"mlflow server pid {stack.mlflow.pid}", at, time.monotonic() - at)


def _kill_postgres(stack: Stack) -> Kill | None:
    proc = postmaster(stack.pg)
    if proc is None:
        return None
    kill_tree(proc)
    at = time.monotonic()
    time.sleep(RESTART_DELAY_S)
    stack.pg.ctl("start")
    return Kill("postgres", f"postmaster pid {proc.pid}", at, time.monotonic() - at)
