"""What a launched worker does first: know its rank, join the process group, name itself on failure.

mpirun gives each rank its place in MPI's own variables (Open MPI: OMPI_COMM_WORLD_RANK/SIZE/
LOCAL_RANK; Intel MPI and MPICH: PMI_RANK/PMI_SIZE/MPI_LOCALRANKID); torch.distributed and
accelerate read RANK/WORLD_SIZE/LOCAL_RANK (with MASTER_ADDR/MASTER_PORT from the launcher), so
they are mapped before accelerate's state exists. On CPUs the process group is started here:
`ccl` when oneCCL's bindings import (Intel's collectives for Xeon), else `gloo`; accelerate then
finds it started and takes it. GPUs: accelerate starts NCCL itself.
"""
from __future__ import annotations

import logging
import os
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from tasks.common.launch import FAILED

log = logging.getLogger(__name__)

#: (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE) as each launcher names them
RANK_VARIABLES = (
    ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),  # torchrun / accelerate
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),  # Intel MPI, MPICH (hydra)
    ("PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_RANK", "PMIX_LOCAL_SIZE"),
)


@dataclass(frozen=True)
class Worker:
    rank: int
    world_size: int
    local_rank: int
    backend: str | None  # torch.distributed backend; None: one process

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def map_rank_environment(environ: dict[str, str] | None = None) -> tuple[int, int, int, int]:
    """Set RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE from whichever launcher's variables are there."""
    env = os.environ if environ is None else environ
    for names in RANK_VARIABLES:
        if names[0] in env and names[1] in env:
            rank, world = int(env[names[0]]), int(env[names[1]])
            local = int(env.get(names[2], rank))
            local_world = int(env.get(names[3], world))
            env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local),
                       LOCAL_WORLD_SIZE=str(local_world))
            return rank, world, local, local_world
    return 0, 1, 0, 1


def cpu_backend() -> str:
    """`ccl` when Intel's oneCCL bindings import (they register it with torch.distributed), else `gloo`."""
    try:
        import oneccl_bindings_for_pytorch  # type: ignore[import-not-found]  # noqa: F401
    except Exception:
        return "gloo"
    return "ccl"


def join() -> Worker:
    """Rank setup for this process (one process: rank 0 of 1, nothing started). Idempotent."""
    import torch

    rank, world, local, _ = map_rank_environment()
    if world == 1:
        return Worker(0, 1, 0, None)
    from accelerate import PartialState

    gpu = torch.cuda.is_available()
    if not gpu and not torch.distributed.is_initialized():
        backend = cpu_backend()
        torch.distributed.init_process_group(backend=backend, rank=rank, world_size=world)
    state = PartialState(cpu=not gpu)
    backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else None
    if state.process_index != rank or state.num_processes != world:
        raise RuntimeError(f"accelerate sees rank {state.process_index} of {state.num_processes}, the launcher "
                           f"{rank} of {world}: another PartialState was created before tasks.common.distributed.join")
    log.info("rank %d of %d (local %d) on %s, torch.distributed backend %s, %s threads", rank, world, local,
             socket.gethostname(), backend, torch.get_num_threads())
    return Worker(rank, world, local, backend)


@contextmanager
def failures_named(worker: Worker) -> Iterator[None]:
    """A failing rank says so on one line the launcher's caller finds (`finetune: rank N ...`)."""
    try:
        yield
    except SystemExit as exit_:
        if worker.world_size > 1 and exit_.code not in (0, None):
            _say(worker, f"exited with code {exit_.code}")
        raise
    except BaseException as err:
        if worker.world_size > 1:
            _say(worker, f"{type(err).__name__}: {err}".replace("\n", " "))
        raise


def _say(worker: Worker, what: Any) -> None:
    print(f"{FAILED} {worker.rank} of {worker.world_size} failed on {socket.gethostname()}: {what}",
          file=sys.stderr, flush=True)
