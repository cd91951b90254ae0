"""Launch commands (tasks.common.launch) for each launcher and both MPI syntaxes, the worker's rank
setup (tasks.common.distributed), config checks, failure parsing and the shipped infra configs.
Fast: nothing is launched here (tests/train/test_distributed.py runs real mpirun), but for a local
stage run that re-executes itself with the allocator preloaded."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.common.allocator import allocator_env, find_allocators
from tasks.common.config import parse_section
from tasks.common.distributed import map_rank_environment
from tasks.common.errors import UserError
from tasks.common.launch import WORKER_ENV, Host, LaunchConfig, _sourced_env, failed_rank, first_host, plan, start
from tasks.train.checkpoints import run_key
from tasks.train.config import TrainConfig
from tests.conftest import REPO

ARGV = ["--base", "models/base", "--out", "models/finetuned"]
PROGRAM = [sys.executable, "-m", "tasks.train", *ARGV]


def host(**kw) -> Host:
    return Host(**{"cores": 8, "is_root": False, "mpi_flavor": "openmpi", "allocators": {}, "oneccl_script": None,
                   **kw})


def test_openmpi_command_forwards_the_environment_and_handles_root_and_containers() -> None:
    p = plan("train", "mpirun", LaunchConfig(num_processes=2, main_port=29555), ARGV, host(is_root=True))
    assert p.cmd[:8] == ["mpirun", "-np", "2", "--map-by", "ppr:2:node", "--bind-to", "none", "--oversubscribe"]
    assert "--allow-run-as-root" in p.cmd and p.cmd[-len(PROGRAM):] == PROGRAM
    assert p.cmd[p.cmd.index("--mca") + 1:p.cmd.index("--mca") + 3] == ["btl_vader_single_copy_mechanism", "none"]
    forwarded = {p.cmd[i + 1] for i, a in enumerate(p.cmd) if a == "-x"}
    assert forwarded == set(p.env) and {WORKER_ENV, "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS"} <= forwarded
    assert p.env["MASTER_ADDR"] == "127.0.0.1" and p.env["MASTER_PORT"] == "29555"
    assert p.env["OMP_NUM_THREADS"] == p.env["MKL_NUM_THREADS"] == "4", "8 cores / 2 ranks"
    assert "--allow-run-as-root" not in plan("train", "mpirun", LaunchConfig(num_processes=2), ARGV, host()).cmd
    assert p.shell().startswith("FINETUNE_LAUNCHED=mpirun GLIBC_TUNABLES=glibc.malloc.mmap_max=0:")  # no tcmalloc
    assert " KMP_BLOCKTIME=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29555 " in p.shell()


def test_openmpi_across_nodes(tmp_path) -> None:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# nodes\n10.0.0.1 slots=4\n10.0.0.2 slots=4\n")
    launch = LaunchConfig(num_processes=8, num_machines=2, hostfile=hostfile, network_interface="ens786f1",
                          threads_per_process=14, env={"CCL_WORKER_COUNT": "1"})
    p = plan("train", "mpirun", launch, ARGV, host())
    assert p.cmd[:5] == ["mpirun", "-np", "8", "--map-by", "ppr:4:node"]
    assert p.cmd[p.cmd.index("--hostfile") + 1] == str(hostfile) and "--oversubscribe" not in p.cmd
    assert "btl_tcp_if_include" in p.cmd and "oob_tcp_if_include" in p.cmd
    assert p.env["MASTER_ADDR"] == "10.0.0.1" and p.env["MASTER_PORT"] == "29500", "the hostfile's first node"
    assert p.env["OMP_NUM_THREADS"] == "14" and p.env["CCL_WORKER_COUNT"] == "1"
    assert p.env["GLOO_SOCKET_IFNAME"] == p.env["I_MPI_HYDRA_IFACE"] == "ens786f1"


def test_hydra_command_is_the_xeon_recipe(tmp_path) -> None:
    """Intel MPI / MPICH: `mpirun -f nodefile -n 16 -ppn 4`, the whole environment forwarded."""
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("192.168.1.10\n192.168.1.11\n192.168.1.12\n192.168.1.13\n")
    launch = LaunchConfig(num_processes=16, num_machines=4, hostfile=nodefile, network_interface="ens786f1")
    for h in (host(mpi_flavor="hydra"), host(mpi_flavor="openmpi")):
        p = plan("train", "mpirun", launch.model_copy(update={"mpi": "auto" if h.mpi_flavor == "hydra" else "hydra"}),
                 ARGV, h)
        assert p.cmd == ["mpirun", "-n", "16", "-ppn", "4", "-genvall", "-f", str(nodefile), "-iface", "ens786f1",
                         *PROGRAM]
        assert p.env["I_MPI_HYDRA_IFACE"] == "ens786f1" and p.env["OMP_NUM_THREADS"] == "2"


def test_no_mpirun_is_a_clear_error() -> None:
    with pytest.raises(UserError, match="no mpirun on PATH. Install Open MPI"):
        plan("train", "mpirun", LaunchConfig(num_processes=2), ARGV, host(mpi_flavor=None))


def test_allocator_preload(tmp_path, monkeypatch) -> None:
    """auto: tcmalloc when installed, else glibc's malloc tuned to keep freed blocks; ranks get it too."""
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")  # the caller's own: kept, after ours
    both = {"tcmalloc": "/usr/lib/libtcmalloc.so.4", "jemalloc": "/usr/lib/libjemalloc.so.2"}
    auto = LaunchConfig(num_processes=2)
    assert plan("train", "mpirun", auto, ARGV, host(allocators=both)).env["LD_PRELOAD"] == both["tcmalloc"]
    only_je = host(allocators={"jemalloc": both["jemalloc"]})
    jemalloc = auto.model_copy(update={"preload_allocator": "jemalloc"})
    assert plan("train", "mpirun", jemalloc, ARGV, only_je).env["LD_PRELOAD"] == both["jemalloc"]
    for found in (host(), only_je):  # nothing installed, or only jemalloc: glibc's own, tuned
        env = plan("train", "mpirun", auto, ARGV, found).env
        assert "LD_PRELOAD" not in env
        assert env["GLIBC_TUNABLES"] == ("glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736:"
                                         "glibc.malloc.top_pad=1073741824:glibc.malloc.arena_max=2")
    none = auto.model_copy(update={"preload_allocator": "none"})
    assert not {"LD_PRELOAD", "GLIBC_TUNABLES"} & set(plan("train", "mpirun", none, ARGV, host(allocators=both)).env)
    with pytest.raises(UserError, match="tcmalloc: libtcmalloc.so .* not found. Install it"):
        plan("train", "mpirun", auto.model_copy(update={"preload_allocator": "tcmalloc"}), ARGV, only_je)


def test_oneccl_env_script_is_sourced(tmp_path, monkeypatch) -> None:
    script = tmp_path / "setvars.sh"
    script.write_text("export CCL_ROOT=/opt/ccl\nexport LD_LIBRARY_PATH=/opt/ccl/lib:$LD_LIBRARY_PATH\n")
    monkeypatch.setenv("LD_LIBRARY_PATH", "/already")
    p = plan("train", "mpirun", LaunchConfig(num_processes=2, oneccl_env_script=str(script)), ARGV, host())
    assert p.source == str(script) and p.shell().startswith(f". {script} && ")
    assert _sourced_env(str(script)) == {"CCL_ROOT": "/opt/ccl", "LD_LIBRARY_PATH": "/opt/ccl/lib:/already"}
    auto = plan("train", "mpirun", LaunchConfig(num_processes=2), ARGV, host(oneccl_script=str(script)))
    assert auto.source == str(script), "auto: the bindings' script when they are installed"
    assert plan("train", "mpirun", LaunchConfig(num_processes=2, oneccl_env_script=None), ARGV,
                host(oneccl_script=str(script))).source is None


def test_accelerate_command(tmp_path, monkeypatch) -> None:
    p = plan("class_images", "accelerate", LaunchConfig(num_processes=4, main_port=29600), ["--out", "x"], host())
    assert p.cmd == [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--mixed_precision", "no",
                     "--dynamo_backend", "no", "--main_process_ip", "127.0.0.1", "--main_process_port", "29600",
                     "--num_processes", "4", "--num_machines", "1", "-m", "tasks.class_images", "--out", "x"]
    config = REPO / "infra" / "accelerate" / "multi_gpu.yaml"
    monkeypatch.setenv("FINETUNE_MACHINE_RANK", "1")
    multi = LaunchConfig(num_processes=16, num_machines=2, main_address="10.0.0.1", accelerate_config=config)
    p = plan("train", "accelerate", multi, ARGV, host())
    assert p.cmd[3:5] == ["--config_file", str(config)] and "--multi_gpu" not in p.cmd
    assert p.cmd[p.cmd.index("--machine_rank") + 1] == "1" and p.cmd[p.cmd.index("--main_process_ip") + 1] == "10.0.0.1"


def test_start_runs_in_place_for_local_in_a_worker_and_for_xla(monkeypatch) -> None:
    for name in (WORKER_ENV, "PJRT_DEVICE", "XLA_USE_SPMD", "XLA_FLAGS", "OMPI_COMM_WORLD_RANK", "PMI_RANK",
                 "PMIX_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)  # and restored after the test
    start("train", "local", LaunchConfig())  # returns: nothing to launch
    for marker in (WORKER_ENV, "OMPI_COMM_WORLD_RANK", "PMI_RANK"):  # ours, or mpirun run by hand
        monkeypatch.setenv(marker, "1")
        start("train", "mpirun", LaunchConfig(num_processes=2), [])  # a worker never launches again
        monkeypatch.delenv(marker)
    start("train", "xla", LaunchConfig(env={"XLA_FLAGS": "--xla_dump_to=/tmp/x"}))
    assert os.environ["PJRT_DEVICE"] == "TPU" and os.environ["XLA_USE_SPMD"] == "1"
    assert os.environ["XLA_FLAGS"] == "--xla_dump_to=/tmp/x" and os.environ[WORKER_ENV] == "xla"


@pytest.mark.parametrize("variables", [
    {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
     "OMPI_COMM_WORLD_LOCAL_SIZE": "2"},
    {"PMI_RANK": "3", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"},
])
def test_mpi_ranks_become_torch_ranks(variables) -> None:
    env = dict(variables)
    assert map_rank_environment(env) == (3, 8, 1, 2)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("3", "8", "1", "2")
    assert map_rank_environment({}) == (0, 1, 0, 1)


def test_failing_rank_is_found_in_each_launchers_report() -> None:
    own = "finetune: rank 1 of 2 failed on node2: OSError: no such file data/processed/img0.png\n"
    openmpi = ("mpirun detected that one or more processes exited with non-zero status, thus causing\n"
               "the job to be terminated. The first process to do so was:\n\n"
               "  Process name: [[4242,1],1]\n  Exit code:    1\n")
    assert failed_rank("noise\n" + own + openmpi) == (1, own.strip())
    hydra = ("===================================================================================\n"
             "=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES\n=   RANK 5 PID 812 RUNNING AT node3\n")
    assert failed_rank(hydra) == (5, "")
    torchrun = "Root Cause (first observed failure):\n[0]:\n  host      : gpu1\n  rank      : 2 (local_rank: 2)\n"
    assert failed_rank(torchrun)[0] == 2
    assert failed_rank(own) == (1, own.strip()) and failed_rank("segfault") == (None, "")
    lost = "finetune: rank 0 of 2 failed on node1: RuntimeError: [pair.cc:553] Connection closed by peer\n"
    assert failed_rank(lost + own + torchrun.replace("2 (local_rank: 2)", "0 (local_rank: 0)"))[0] == 1, \
        "rank 0 only lost its peer: rank 1 is the cause whatever the launcher saw first"
    assert failed_rank(lost + openmpi.replace("],1]", "],0]"))[0] == 0


def test_config_checks_name_the_key(tmp_path) -> None:
    def load(**section) -> TrainConfig:
        return parse_section("train", section, TrainConfig)

    with pytest.raises(UserError, match="launcher local runs one process: set launcher mpirun"):
        load(launch={"num_processes": 2})
    with pytest.raises(UserError, match="mpirun across machines needs launch.hostfile"):
        load(launcher="mpirun", launch={"num_processes": 4, "num_machines": 2})
    with pytest.raises(UserError, match="accelerate across machines needs launch.main_address"):
        load(launcher="accelerate", launch={"num_processes": 4, "num_machines": 2})
    with pytest.raises(UserError, match="multiple of launch.num_machines"):
        load(launcher="mpirun", launch={"num_processes": 3, "num_machines": 2, "hostfile": None})
    with pytest.raises(UserError,
                       match=r"train\.launch\.num_procs: unknown key .* Did you mean 'train\.launch\.num_processes'"):
        load(launch={"num_procs": 2})
    with pytest.raises(UserError, match=r"train\.launcher"):
        load(launcher="slurm")
    with pytest.raises(UserError, match="launch.hostfile .* not found"):
        load(launcher="mpirun", launch={"hostfile": str(tmp_path / "missing")})
    assert first_host(REPO / "infra" / "hostfile.example") == "192.168.1.10"
    from tasks.class_images.config import ClassImagesConfig

    with pytest.raises(UserError, match=r"class_images: .*launcher xla is for training"):
        parse_section("class_images", {"launcher": "xla"}, ClassImagesConfig)


def test_run_key_keeps_launch_settings_but_not_the_process_count(tiny_sd, instance_dir) -> None:
    files = [instance_dir / "metadata.jsonl"]
    local = TrainConfig()
    launched = TrainConfig(launcher="mpirun", launch={"num_processes": 2, "threads_per_process": 3, "env": {"A": "1"}})
    assert run_key(local, tiny_sd, files)[0] == run_key(launched, tiny_sd, files)[0]
    assert run_key(launched, tiny_sd, files, num_processes=2)[0] != run_key(launched, tiny_sd, files)[0]


@pytest.mark.parametrize("name", ["cpu_mpi.yaml", "multi_gpu.yaml", "tpu.yaml"])
def test_shipped_accelerate_configs_load(name) -> None:
    from accelerate.commands.config.config_args import ClusterConfig

    config = ClusterConfig.from_yaml_file(REPO / "infra" / "accelerate" / name)
    assert config.compute_environment.value == "LOCAL_MACHINE"
    expected = {"cpu_mpi.yaml": "MULTI_CPU", "multi_gpu.yaml": "MULTI_GPU", "tpu.yaml": "XLA"}[name]
    assert config.distributed_type.value == expected
    assert Path(REPO / "infra" / "hostfile.example").is_file()


PRELOADABLE = allocator_env("tcmalloc", find_allocators())["LD_PRELOAD"] if "tcmalloc" in find_allocators() else None
needs_allocator = pytest.mark.skipif(PRELOADABLE is None, reason="no tcmalloc: apt-get install "
                                     "libtcmalloc-minimal4 (.ci/run installs it)")
GLIBC_TUNED = allocator_env("glibc", {})
REALLOCATE = """
import resource
import torch
def step():  # one step's large blocks: bf16 weight copies (256 MB, a LoRA'd SD 1.5 UNet's), activations
    x = torch.ones(64 * 2**20)
    y = torch.ones(3 * 2**20)
    z = x + 1
    del x, y, z
for _ in range(8):  # the first steps: an allocator that keeps blocks settles on where they go
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):  # the next steps allocate the same again
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(extra: dict[str, str]) -> int:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "GLIBC_TUNABLES")}
    out = subprocess.run([sys.executable, "-c", REALLOCATE], capture_output=True, text=True, check=True,
                         env={**env, **extra})
    return int(out.stdout.split()[-1])


def test_glibc_tuned_serves_the_next_steps_blocks_without_page_faults() -> None:
    """Page faults do not depend on the machine's load: glibc as it comes unmaps a freed 256 MB block
    and the kernel faults 65,536 pages back in, zeroed, at each reallocation (3 steps: 393,000
    pages); glibc tuned by
    GLIBC_TUNABLES (auto's choice where tcmalloc is not installed) keeps the block, nothing installed.
    The tuned count is the lower of two runs: once, on a CI machine busy with other tests, one run
    faulted a single 256 MB block in (65,536 pages, once, not per step); the defaults fault every step."""
    assert _faults({}) > 3 * 120_000
    assert min(_faults(GLIBC_TUNED), _faults(GLIBC_TUNED)) < 1_000


@needs_allocator
def test_the_preloaded_allocator_serves_the_next_steps_blocks_without_page_faults() -> None:
    assert _faults({"LD_PRELOAD": PRELOADABLE}) < 1_000


def test_the_allocator_in_use_is_named(monkeypatch) -> None:
    """What the log, the train report and the MLflow run say: read from the process itself."""
    def named(extra: dict[str, str]) -> str:
        env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "GLIBC_TUNABLES", "MALLOC_MMAP_MAX_")}
        code = "from tasks.common.allocator import in_use; print(in_use())"
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              env={**env, **extra, "PYTHONPATH": str(REPO)}).stdout.strip()

    assert named({}) == "glibc-defaults"
    assert named(GLIBC_TUNED) == named({"MALLOC_MMAP_MAX_": "0"}) == "glibc-tuned"
    if PRELOADABLE:
        assert named({"LD_PRELOAD": PRELOADABLE}) == "tcmalloc"


@pytest.mark.parametrize("allocator", ["auto", "glibc"])
def test_a_local_stage_run_re_executes_itself_once_with_the_allocator(tmp_path, allocator) -> None:
    """`python -m tasks.train` (launcher local) starts again with the allocator's environment, once,
    and runs the stage there (here: to its first check); in-process callers such as this test are
    never replaced. auto: tcmalloc where installed, else glibc tuned; glibc: that, always."""
    (tmp_path / "params.yaml").write_text(f"train: {{launch: {{preload_allocator: {allocator}}}}}\n")
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "FINETUNE_PRELOADED", "GLIBC_TUNABLES")}
    proc = subprocess.run([sys.executable, "-m", "tasks.train", "--base", str(tmp_path / "none"), "--data", "d",
                           "--class-data", "c", "--out", "o", "--report", "r.json", "--plot", "l.csv",
                           "--params", "params.yaml"], capture_output=True, text=True, cwd=tmp_path,
                          env={**env, "PYTHONPATH": str(REPO)}, timeout=120)
    wanted = (f"LD_PRELOAD={PRELOADABLE}" if allocator == "auto" and PRELOADABLE
              else f"GLIBC_TUNABLES={GLIBC_TUNED['GLIBC_TUNABLES']}")
    assert proc.stderr.count(f"re-executing with {wanted}") == 1, proc.stderr[-2000:]
    assert proc.stderr.count("is not a diffusers pipeline folder") == 1 and proc.returncode == 2  # UserError
    start("train", "local", LaunchConfig())  # in pytest: returns, the test process goes on


def test_stage_programs_load_no_torch_before_the_launcher_starts() -> None:
    """What runs before `start()` (re-executing under the allocator, or handing over to mpirun or
    accelerate and waiting) imports no torch, diffusers, accelerate or MLflow: 2 s per stage run."""
    heavy = ("torch", "diffusers", "accelerate", "mlflow")
    out = subprocess.run([sys.executable, "-c", "import sys, tasks.train.__main__, tasks.class_images.__main__; "
                          f"print([m for m in {heavy!r} if m in sys.modules])"],
                         capture_output=True, text=True, check=True, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.stdout.strip() == "[]", out.stdout
