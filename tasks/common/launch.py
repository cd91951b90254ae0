"""Where a stage runs and on how many processes: `local | accelerate | mpirun | xla`, from params.

`python -m tasks.<stage>` reads `<stage>.launcher` and `<stage>.launch` and, unless it already
runs inside a launched worker, re-executes itself (`python -m tasks.<stage> <same arguments>`)
under the launcher. The exact command is printed and logged: run it by hand on a node to debug.
Children carry `FINETUNE_LAUNCHED`, so a worker never launches again. What a worker does on
start (ranks from the MPI environment, the torch.distributed backend) is in
`tasks.common.distributed`.

- `local`: this process, one rank (what the stage did before launchers existed).
- `mpirun`: Hydra syntax (Intel MPI, MPICH: `-f hostfile -n N -ppn P -genvall`) or Open MPI
  (`--hostfile`, `-np`, `--map-by ppr:P:node`, `-x VAR` per variable), detected from
  `mpirun --version` (`mpi: auto`). The environment the Xeon recipe sets by hand is set from params:
  threads per rank (OMP/MKL, KMP_BLOCKTIME), tcmalloc or jemalloc in LD_PRELOAD, the network
  interface (I_MPI_HYDRA_IFACE, Open MPI's tcp include lists, GLOO/NCCL/CCL socket names) and
  oneCCL's env script. Open MPI inside containers: `--bind-to none` (threads are limited by
  OMP_NUM_THREADS instead of a core mask), `--mca btl_vader_single_copy_mechanism none` (no
  ptrace-based copies, which containers forbid), `--oversubscribe` on one machine, and
  `--allow-run-as-root` when run as root (Open MPI refuses root otherwise).
- `accelerate`: `accelerate launch` (torchrun underneath: multi-GPU, multi-node with NCCL), with
  `accelerate_config` for everything beyond the topology (FSDP, DeepSpeed, ...).
- `xla`: no new process: PJRT's environment is set here and the stage runs one process per host
  (SPMD shards the batch over the host's devices).
"""
from __future__ import annotations

import logging
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import Field

from tasks.common.allocator import Allocator, allocator_env, find_allocators, preload_locally
from tasks.common.config import StageConfig
from tasks.common.credentials import redact
from tasks.common.errors import UserError
from tasks.common.stop_signals import OPEN_MPI, WORKER_ENV, relay, wait_for_group

log = logging.getLogger(__name__)

LAUNCHERS = ("local", "accelerate", "mpirun", "xla")
Launcher = Literal["local", "accelerate", "mpirun", "xla"]
MACHINE_RANK_ENV = "FINETUNE_MACHINE_RANK"  # accelerate across machines: this node's index
FAILED = "finetune: rank"  # start of the line a failing worker prints (tasks.common.distributed)
DEFAULT_PORT = 29500
#: passed on to every rank when set here (Open MPI forwards only what `-x` names to other nodes)
FORWARDED = ("PYTHONPATH", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "FINETUNE_PARENT_RUN_ID",
             "FINETUNE_MLFLOW_WAIT_S", "HF_HOME", "HF_HUB_OFFLINE")


class LaunchConfig(StageConfig):
    """`<stage>.launch`: the topology and environment of a launched run (`local` uses only
    `preload_allocator`)."""

    num_processes: int = Field(1, ge=1, le=65536, description="processes (ranks) in all")
    num_machines: int = Field(1, ge=1, le=4096, description="nodes; > 1 needs a hostfile (mpirun) or main_address")
    processes_per_node: int | None = Field(None, ge=1, description="null: num_processes / num_machines")
    hostfile: Path | None = Field(None, description="MPI hostfile, one node per line, the main node first")
    main_address: str | None = Field(None, description="rank 0's IP; null: 127.0.0.1, or the hostfile's first host")
    main_port: int | None = Field(None, ge=1, le=65535, description="null: a free port on one machine, else 29500")
    mpi: Literal["auto", "hydra", "openmpi"] = Field("auto", description="mpirun syntax; auto: from mpirun --version")
    threads_per_process: int | None = Field(
        None, ge=1, description="OMP/MKL threads per rank; null: this machine's cores / ranks per node")
    preload_allocator: Allocator = Field(
        "auto", description="a malloc that keeps freed blocks for the next step (local runs too): tcmalloc or "
                            "jemalloc in LD_PRELOAD, or glibc's own tuned by GLIBC_TUNABLES; auto: tcmalloc when "
                            "installed, else glibc tuned; none: the environment as it is")
    network_interface: str | None = Field(None, description="NIC between the nodes (e.g. ens786f1); null: any")
    oneccl_env_script: str | None = Field(
        "auto", description="sourced before mpirun; auto: oneCCL bindings' env/setvars.sh when installed; null: none")
    env: dict[str, str] = Field(default_factory=dict, description=(
        "extra environment for every rank; the value of a secret-looking name (PASSWORD, TOKEN, SECRET, KEY, "
        "AUTH, CREDENTIAL) shows as *** in logs and MLflow params. Secrets belong in the environment, not here"))
    accelerate_config: Path | None = Field(None, description="`accelerate launch --config_file` (launcher accelerate)")

    @property
    def per_node(self) -> int:
        return self.processes_per_node or max(1, self.num_processes // self.num_machines)


def launch_problem(launcher: str, launch: LaunchConfig) -> str | None:
    """A contradiction between launcher and topology, found at config load (None: fine)."""
    if launcher == "local" and launch.num_processes > 1:
        return ("launcher local runs one process: set launcher mpirun (CPUs) or accelerate (GPUs) for "
                f"launch.num_processes {launch.num_processes}")
    if launch.processes_per_node is None and launch.num_processes % launch.num_machines:
        return "launch.num_processes must be a multiple of launch.num_machines (or set launch.processes_per_node)"
    if launch.per_node * launch.num_machines < launch.num_processes:
        return "launch.processes_per_node x launch.num_machines is smaller than launch.num_processes"
    if launch.hostfile is not None and not Path(launch.hostfile).is_file():
        return f"launch.hostfile {launch.hostfile} not found (see infra/hostfile.example)"
    if launcher == "mpirun" and launch.num_machines > 1 and launch.hostfile is None:
        return "mpirun across machines needs launch.hostfile (one node per line, the main node first)"
    if launcher == "accelerate" and launch.num_machines > 1 and not launch.main_address:
        return "accelerate across machines needs launch.main_address (the IP of machine rank 0)"
    if launch.accelerate_config is not None and not Path(launch.accelerate_config).is_file():
        return f"launch.accelerate_config {launch.accelerate_config} not found (see infra/accelerate/)"
    return None


@dataclass
class Host:
    """What the command depends on besides params; detected, or given by tests."""

    cores: int
    is_root: bool
    mpi_flavor: str | None  # "openmpi" | "hydra" | None (no mpirun)
    allocators: dict[str, str]  # name -> library path found
    oneccl_script: str | None  # the oneCCL bindings' env script, when installed

    @classmethod
    def detect(cls) -> Host:
        return cls(len(os.sched_getaffinity(0)), os.geteuid() == 0, _mpi_flavor(), find_allocators(),
                   _oneccl_script())


@dataclass
class LaunchPlan:
    """The launcher command, the environment it adds, and a shell line that reproduces it (for logs:
    secret-looking values of the environment show as ***)."""

    cmd: list[str]
    env: dict[str, str] = field(default_factory=dict)
    source: str | None = None  # a script sourced before the command (oneCCL)
    stop_as: dict[int, int] = field(default_factory=dict)  # how the first SIGTERM/SIGINT is passed on

    def shell(self) -> str:
        assignments = [f"{k}={shlex.quote(v)}" for k, v in sorted(redact(self.env).items())]
        line = " ".join([*assignments, shlex.join(self.cmd)])
        return f". {shlex.quote(self.source)} && {line}" if self.source else line


def _mpi_flavor() -> str | None:
    exe = shutil.which("mpirun")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return "openmpi" if "Open MPI" in out.stdout + out.stderr else "hydra"


def _oneccl_script() -> str | None:
    try:
        from oneccl_bindings_for_pytorch import cwd  # type: ignore[import-not-found]
    except Exception:
        return None
    script = Path(cwd) / "env" / "setvars.sh"
    return str(script) if script.is_file() else None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def first_host(hostfile: Path) -> str:
    """The first node of an MPI hostfile (`host`, `host:slots` or `host slots=N`; # comments)."""
    for line in Path(hostfile).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            return line.split()[0].split(":")[0]
    raise UserError(f"launch.hostfile {hostfile} lists no host: one node per line, the main node first")


def rank_env(launcher: str, launch: LaunchConfig, host: Host) -> dict[str, str]:
    """Variables every rank gets: marker, rendezvous, threads, allocator, interface, user's `env`."""
    env = {WORKER_ENV: launcher, **{k: os.environ[k] for k in FORWARDED if k in os.environ}}
    if launch.main_address:
        address = launch.main_address
    elif launch.num_machines > 1 and launch.hostfile is not None:
        address = first_host(launch.hostfile)
    else:
        address = "127.0.0.1"
    port = launch.main_port or (DEFAULT_PORT if launch.num_machines > 1 else _free_port())
    env.update(MASTER_ADDR=address, MASTER_PORT=str(port))
    threads = launch.threads_per_process or max(1, host.cores // launch.per_node)
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), KMP_BLOCKTIME="1")
    env.update(allocator_env(launch.preload_allocator, host.allocators))
    if launch.network_interface:
        nic = launch.network_interface
        env.update(I_MPI_HYDRA_IFACE=nic, GLOO_SOCKET_IFNAME=nic, NCCL_SOCKET_IFNAME=nic, CCL_SOCKET_IFNAME=nic)
    env.update(launch.env)
    return env


def oneccl_script(launch: LaunchConfig, host: Host) -> str | None:
    if launch.oneccl_env_script is None:
        return None
    if launch.oneccl_env_script == "auto":
        return host.oneccl_script
    if not Path(launch.oneccl_env_script).is_file():
        raise UserError(f"launch.oneccl_env_script {launch.oneccl_env_script} not found; set auto or null")
    return launch.oneccl_env_script


def mpi_flavor(launch: LaunchConfig, host: Host) -> str | None:
    """openmpi | hydra: `launch.mpi`, or what `mpirun --version` says (None: no mpirun)."""
    return host.mpi_flavor if launch.mpi == "auto" else launch.mpi


def mpirun_command(launch: LaunchConfig, host: Host, env: dict[str, str], program: list[str]) -> list[str]:
    """`mpirun` in the syntax of the installed MPI (or `launch.mpi`), forwarding `env` to every rank."""
    flavor = mpi_flavor(launch, host)
    if flavor is None:
        raise UserError("launcher mpirun: no mpirun on PATH. Install Open MPI (apt-get install openmpi-bin) or "
                        "Intel MPI (pip install impi_rt), or set the launcher to local")
    n, ppn = str(launch.num_processes), str(launch.per_node)
    if flavor == "hydra":
        cmd = ["mpirun", "-n", n, "-ppn", ppn, "-genvall"]
        if launch.hostfile is not None:
            cmd += ["-f", str(launch.hostfile)]
        if launch.network_interface:
            cmd += ["-iface", launch.network_interface]
        return cmd + program
    cmd = ["mpirun", "-np", n, "--map-by", f"ppr:{ppn}:node", "--bind-to", "none"]
    if launch.hostfile is not None:
        cmd += ["--hostfile", str(launch.hostfile)]
    else:
        cmd += ["--oversubscribe"]
    if host.is_root:
        cmd += ["--allow-run-as-root"]
    cmd += ["--mca", "btl_vader_single_copy_mechanism", "none"]
    if launch.network_interface:
        nic = launch.network_interface
        cmd += ["--mca", "btl_tcp_if_include", nic, "--mca", "oob_tcp_if_include", nic]
    for name in sorted(env):
        cmd += ["-x", name]
    return cmd + program


def accelerate_command(launch: LaunchConfig, env: dict[str, str], program: list[str]) -> list[str]:
    """`accelerate launch`: params give the topology, `accelerate_config` the rest."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch"]
    if launch.accelerate_config is not None:
        cmd += ["--config_file", str(launch.accelerate_config)]
    elif launch.num_processes > 1:
        cmd += ["--multi_gpu", "--mixed_precision", "no", "--dynamo_backend", "no"]
    cmd += ["--main_process_ip", env["MASTER_ADDR"], "--main_process_port", env["MASTER_PORT"],
            "--num_processes", str(launch.num_processes), "--num_machines", str(launch.num_machines)]
    if launch.num_machines > 1:
        cmd += ["--machine_rank", os.environ.get(MACHINE_RANK_ENV, "0")]
    return cmd + program[1:]  # accelerate runs `python` itself: `-m tasks.<stage> ...`


def plan(stage: str, launcher: str, launch: LaunchConfig, argv: list[str], host: Host | None = None) -> LaunchPlan:
    """The command that runs `python -m tasks.<stage> argv` under `launcher` (mpirun | accelerate)."""
    return plan_program(launcher, launch, [sys.executable, "-m", f"tasks.{stage}", *argv], host)


def plan_program(launcher: str, launch: LaunchConfig, program: list[str], host: Host | None = None) -> LaunchPlan:
    """The command that runs `program` (python and its arguments) under `launcher`."""
    host = host or Host.detect()
    env = rank_env(launcher, launch, host)
    if launcher == "mpirun":
        stop_as = OPEN_MPI if mpi_flavor(launch, host) == "openmpi" else {}
        return LaunchPlan(mpirun_command(launch, host, env, program), env, oneccl_script(launch, host), stop_as)
    if launcher == "accelerate":
        return LaunchPlan(accelerate_command(launch, env, program), env)
    raise ValueError(f"launcher {launcher!r} starts no new process")


def xla_env(launch: LaunchConfig) -> dict[str, str]:
    """PJRT's environment for the in-process XLA run: TPU unless `launch.env` says otherwise."""
    return {WORKER_ENV: "xla", "PJRT_DEVICE": os.environ.get("PJRT_DEVICE", "TPU"), "XLA_USE_SPMD": "1",
            **launch.env}


def _sourced_env(script: str) -> dict[str, str]:
    """The variables `. script` sets or changes (oneCCL's setvars.sh: library paths, CCL_ROOT, ...)."""
    out = subprocess.run(["bash", "-c", f"env -0; printf '\\0--\\0'; . {shlex.quote(script)} >/dev/null 2>&1; env -0"],
                         capture_output=True, check=True).stdout.decode()
    before, after = (dict(item.split("=", 1) for item in part.split("\0") if "=" in item)
                     for part in out.split("\0--\0", 1))
    return {k: v for k, v in after.items() if before.get(k) != v and k not in ("_", "SHLVL")}


#: errors a rank gets because another rank died first (its collectives lose their peer)
PEER_LOST = re.compile(r"Connection (closed|reset) by peer|remote worker crash|Broken pipe|remote process exited",
                       re.I)


def failed_rank(text: str) -> tuple[int | None, str]:
    """(rank, its error line) from a launcher's output. First the first rank whose own line is not a
    lost-peer error (the others only lost it), then the launcher's report of the first rank that
    exited (Open MPI, Hydra, torchrun), then the first rank that said it failed."""
    own: dict[int, str] = {}
    for match in re.finditer(rf"^{re.escape(FAILED)} (\d+)\b.*$", text, re.M):
        own.setdefault(int(match.group(1)), match.group(0))
    cause = next((rank for rank, line in own.items() if not PEER_LOST.search(line)), None)
    if cause is not None:
        return cause, own[cause]
    for pattern in (r"Process name: \[\[\d+,\d+\],(\d+)\]",  # Open MPI: "the first process to do so"
                    r"RANK (\d+) PID \d+ RUNNING AT",  # Intel MPI / MPICH hydra
                    r"rank\s*:\s*(\d+) \(local_rank"):  # torchrun's root-cause summary
        match = re.search(pattern, text)
        if match:
            rank = int(match.group(1))
            return rank, own.get(rank, "")
    if own:
        rank = next(iter(own))
        return rank, own[rank]
    return None, ""


def _run(plan_: LaunchPlan, total: int) -> None:
    env = {**os.environ, **(_sourced_env(plan_.source) if plan_.source else {}), **plan_.env}
    # a process group of its own: a terminal's Ctrl-C reaches the ranks once, through `relay`
    proc = subprocess.Popen(plan_.cmd, env=env, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, process_group=0)
    signals = relay(proc, plan_.stop_as)
    tail = bytearray()

    def pump() -> None:  # the ranks' stderr, passed through as it comes and kept for the report
        assert proc.stderr is not None
        while chunk := os.read(proc.stderr.fileno(), 65536):
            sys.stderr.buffer.write(chunk)
            sys.stderr.buffer.flush()
            tail.extend(chunk)
            del tail[:-262144]

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    code = proc.wait()
    if signals:
        wait_for_group(proc.pid)
    reader.join(timeout=10)
    if code == 0:
        sys.exit(0)
    if signals:  # stopped on request (the ranks saved a checkpoint): 128 + signal, as a local run exits
        name = signal.Signals(signals[0]).name
        print(f"error: stopped by {name}, passed to every rank (launcher exit code {code})", file=sys.stderr)
        sys.exit(128 + signals[0])
    code = 128 - code if code < 0 else code
    rank, line = failed_rank(tail.decode(errors="replace"))
    who = f"rank {rank} of {total}" if rank is not None else "a rank (the launcher did not say which)"
    if code > 128:  # stopped by a signal (SIGTERM/SIGINT save a checkpoint): keep the code for retries
        print(f"error: the launched run stopped with exit code {code} ({who})", file=sys.stderr)
        sys.exit(code)
    detail = f": {line.split(':', 2)[-1].strip()}" if line else ""
    raise UserError(f"{who} failed (launcher exit code {code}){detail}. To debug, train on that node alone "
                    f"(launcher: local), or run the launcher command by hand: {plan_.shell()}")


def launched() -> bool:
    """True inside a launched process: ours (FINETUNE_LAUNCHED), or any MPI / torchrun rank (a command
    run by hand under mpirun or torchrun must not launch again either)."""
    markers = (WORKER_ENV, "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "TORCHELASTIC_RUN_ID")
    return any(os.environ.get(name) for name in markers)


def start(stage: str, launcher: str, launch: LaunchConfig, argv: list[str] | None = None) -> None:
    """Run the stage under `launcher`: returns at once in a worker or for `local`; sets PJRT's
    environment and returns for `xla`; otherwise runs the launcher and exits with its outcome."""
    if launched():
        return
    if launcher == "local":
        preload_locally(stage, launch.preload_allocator)
        return
    if launcher == "xla":
        env = xla_env(launch)
        os.environ.update(env)
        log.info("launcher xla: %s (one process per host; run the same command on every host)",
                 " ".join(f"{k}={v}" for k, v in sorted(redact(env).items())))
        return
    the_plan = plan(stage, launcher, launch, list(sys.argv[1:] if argv is None else argv))
    line = the_plan.shell()
    print(f"launching {launch.num_processes} processes on {launch.num_machines} machine(s): {line}",
          file=sys.stderr, flush=True)
    log.info("%s launched with: %s", stage, line)
    _run(the_plan, launch.num_processes)
