"""Real multi-process training: `python -m tasks.train` re-executes itself under a real `mpirun -np 2`
on loopback (gloo), only rank 0 writes, 2 ranks x batch 1 reach the weights of 1 rank x batch 2,
a rank that fails is named, SIGTERM reaches every rank (a checkpoint, then a 2-rank resume), and a stop
request leaves the ranks of either launcher the time they need to save."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import yaml
from safetensors.torch import load_file

from tasks.train.config import TrainConfig
from tasks.train.core import train
from tests.conftest import REPO, stage_runs

UNET = "unet/diffusion_pytorch_model.safetensors"
pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None,
                                reason="needs mpirun: apt-get install openmpi-bin (.ci/run installs it)")
# adam_epsilon well above float noise: some UNet biases (those right before a GroupNorm) have a
# gradient that is exactly zero in exact arithmetic; Adam would blow their rounding noise (which
# differs with the summation order of 1 vs 2 ranks) up to steps of the full learning rate.
SETTINGS = dict(max_train_steps=3, resolution=32, num_validation_images=0, learning_rate=1e-3, lr_scheduler="linear",
                random_flip=True, checkpointing_steps=2, system_metrics_interval=0, resume="none", adam_epsilon=1e-4)


def stage_command(tmp_path: Path, section: dict, inputs: tuple[Path, Path, Path]) -> list[str]:
    """`python -m tasks.train` over `inputs` with `section` as params.yaml's train section."""
    tiny_sd, instance_dir, class_dir = inputs
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"train": section}))
    return [sys.executable, "-m", "tasks.train", "--base", str(tiny_sd), "--data", str(instance_dir),
            "--class-data", str(class_dir), "--out", str(tmp_path / "out"), "--report", str(tmp_path / "train.json"),
            "--plot", str(tmp_path / "loss.csv"), "--params", str(params)]


def run_stage(tmp_path: Path, section: dict, inputs: tuple[Path, Path, Path], env: dict | None = None):
    return subprocess.run(stage_command(tmp_path, section, inputs), capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})}, timeout=300)


#: two ranks training until signalled, a checkpoint folder to stop into
ENDLESS = {**SETTINGS, "max_train_steps": 100_000, "checkpointing_steps": 100_000, "train_batch_size": 1,
           "resume": "latest", "launcher": "mpirun", "launch": {"num_processes": 2, "threads_per_process": 1}}


def start_until_both_ranks_train(tmp_path: Path, section: dict, inputs: tuple[Path, Path, Path]) -> subprocess.Popen:
    """The stage under mpirun, returned once both ranks are in the loop with their signal handlers set."""
    proc = subprocess.Popen(stage_command(tmp_path, section, inputs), stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, text=True, cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        ready = 0
        assert proc.stderr is not None
        for line in proc.stderr:
            ready += "SIGTERM/SIGINT save a checkpoint" in line
            if ready == 2:
                return proc
        raise AssertionError("the stage ended before both ranks trained")
    except BaseException:
        _kill_tree(proc.pid)
        raise


def _kill_tree(pid: int) -> None:
    """The launcher and its mpirun ranks: a failed assertion leaves no rank training on."""
    try:
        root = psutil.Process(pid)
        procs = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


@pytest.fixture(scope="module")
def even_instances(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 instance images: with 4 class images, 2 batches of 2 (or 2 x 2 ranks of 1) per epoch."""
    from tests.train.conftest import write_imagefolder

    return write_imagefolder(tmp_path_factory.mktemp("even") / "processed", 4, "a photo of sks toy", 7)


@pytest.mark.parametrize("base_name, weights, extra", [
    ("tiny_sd", UNET, {}),
    ("tiny_flux", "transformer/diffusion_pytorch_model.safetensors", {"max_sequence_length": 16}),
])
def test_two_ranks_equal_one_rank_with_twice_the_batch(
    request, tmp_path, base_name, weights, extra, even_instances, class_dir, isolated_mlflow
) -> None:
    """Both objectives: DDPM (SD) and flow matching (FLUX)."""
    tiny_sd = request.getfixturevalue(base_name)
    settings = {**SETTINGS, **extra}
    section = {**settings, "train_batch_size": 1, "checkpoints_dir": str(tmp_path / "ckpt"),
               "launcher": "mpirun", "launch": {"num_processes": 2, "threads_per_process": 1}}
    done = run_stage(tmp_path, section, (tiny_sd, even_instances, class_dir))
    assert done.returncode == 0, done.stderr[-4000:]
    assert "launching 2 processes on 1 machine(s): " in done.stderr and " mpirun -np 2 " in done.stderr
    assert "rank 1 of 2 (local 1)" in done.stderr and "backend gloo" in done.stderr
    report = json.loads((tmp_path / "train.json").read_text())
    assert report["steps"] == 3
    runs = stage_runs(isolated_mlflow)
    assert len(runs) == 1 and runs[0].data.params["launcher"] == "mpirun", "one MLflow run: rank 0's"
    checkpoint = next((tmp_path / "ckpt").glob("*/checkpoint-2"))
    assert {"random_states_0.pkl", "random_states_1.pkl"} <= {p.name for p in checkpoint.iterdir()}

    torch.set_num_threads(1)
    single = TrainConfig(**{**settings, "train_batch_size": 2, "checkpoints_dir": tmp_path / "ckpt1"})
    outcome = train(single, tiny_sd, even_instances, class_dir, tmp_path / "single")
    assert [h[1] for h in outcome.losses] == pytest.approx([h[1] for h in
                                                            _csv_losses(tmp_path / "loss.csv")], rel=1e-4)
    two, one = load_file(tmp_path / "out" / weights), load_file(tmp_path / "single" / weights)
    base = load_file(tiny_sd / weights)
    moved = max(float((one[k] - base[k]).abs().max()) for k in one)
    worst = max(float((two[k] - one[k]).abs().max()) for k in one)
    assert moved > 1e-3, "the weights trained"
    assert worst < 1e-5, f"2 ranks x 1 and 1 rank x 2 differ by {worst} (training moved them by {moved})"


def _csv_losses(path: Path) -> list[list[float]]:
    rows = path.read_text().splitlines()[1:]
    return [[float(x) for x in row.split(",")] for row in rows]


@pytest.mark.parametrize("launcher", ["mpirun", "accelerate"])
def test_a_failing_rank_is_named(tmp_path, tiny_sd, instance_dir, class_dir, launcher) -> None:
    """Rank 1 cannot read the images (as a node whose data folder differs); the job stops, naming it.
    `accelerate` runs torchrun, which works on CPUs too (gloo)."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os\n"
        "rank = os.environ.get('OMPI_COMM_WORLD_RANK', os.environ.get('RANK'))\n"
        "if rank == '1' and os.environ.get('FINETUNE_LAUNCHED'):\n"
        "    import PIL.Image\n"
        "    def broken(*args, **kwargs):\n"
        "        raise OSError('cannot read the images on this node')\n"
        "    PIL.Image.open = broken\n")
    section = {**SETTINGS, "train_batch_size": 1, "checkpoints_dir": str(tmp_path / "ckpt"),
               "launcher": launcher, "launch": {"num_processes": 2, "threads_per_process": 1}}
    done = run_stage(tmp_path, section, (tiny_sd, instance_dir, class_dir),
                     env={"PYTHONPATH": f"{hook}{os.pathsep}{REPO}"})
    assert done.returncode == 2, done.stderr[-4000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: rank 1 of 2 failed (launcher exit code 1): "), last
    assert "cannot read the images on this node" in last and "train on that node alone" in last
    assert ("mpirun -np 2" if launcher == "mpirun" else "accelerate.commands.launch --multi_gpu") in last
    assert not (tmp_path / "out").exists() and not (tmp_path / "train.json").exists()


#: a rank that answers a stop request as training does, only slower: argv[1] s to "finish its step and save"
SLOW_SAVER = """
import os, sys, time
from pathlib import Path
from tasks.train.interrupts import stop_on_signals
with stop_on_signals() as stop:
    Path(f"ready-{os.getpid()}").touch()
    while not stop.requested:
        time.sleep(0.02)
    time.sleep(float(sys.argv[1]))
    print(f"saved after {stop.name}", file=sys.stderr, flush=True)
sys.exit(128 + stop.signum)
"""
#: the stage's launcher side: `slow_saver.py` on N ranks under a launcher, as `python -m tasks.train` runs ranks
LAUNCHER = """
import sys
from tasks.common.launch import LaunchConfig, _run, plan_program
launcher, n, save_s = sys.argv[1], int(sys.argv[2]), sys.argv[3]
_run(plan_program(launcher, LaunchConfig(num_processes=n, threads_per_process=1),
                  [sys.executable, "slow_saver.py", save_s]), n)
"""


@pytest.mark.parametrize("ctrl_c", [False, True], ids=["sigterm-to-the-stage", "ctrl-c-to-its-process-group"])
@pytest.mark.parametrize("launcher,ranks", [("mpirun", 2), ("accelerate", 2), ("accelerate", 1)])
def test_ranks_get_as_long_as_they_need_to_save(tmp_path, launcher, ranks, ctrl_c) -> None:
    """SIGTERM to the stage, or SIGINT to its whole process group (a terminal's Ctrl-C): every rank hears it
    once and may take its time to save (Open MPI's mpirun kills its ranks 1 s after a SIGTERM or SIGINT of
    its own; the launcher passes the first request through it as SIGUSR2 / SIGUSR1). A single-process
    `accelerate launch` passes no signal on and exits at once: its worker hears the request from the
    process group, and the stage waits for it (12 s, longer than the stage waits for the ranks' output)."""
    (tmp_path / "slow_saver.py").write_text(SLOW_SAVER)
    save_s = "12" if ranks == 1 else "3"
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, launcher, str(ranks), save_s], stderr=subprocess.PIPE,
                            text=True, cwd=tmp_path, process_group=0, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        # each rank marks itself ready with a file (not its output: the launcher may forward that late or merged)
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("ready-*"))) < ranks and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(list(tmp_path.glob("ready-*"))) == ranks, f"{ranks} ranks did not start in 120 s"
        asked = signal.SIGINT if ctrl_c else signal.SIGTERM
        if ctrl_c:
            os.killpg(proc.pid, asked)
        else:
            proc.send_signal(asked)
        rest = proc.communicate(timeout=60)[1]
    finally:
        _kill_tree(proc.pid)
    assert rest.count(f"saved after {asked.name}") == ranks, rest
    assert proc.returncode == 128 + asked and f"error: stopped by {asked.name}, passed to every rank" in rest


def test_a_signal_seen_by_one_rank_stops_every_rank_after_the_same_step(tmp_path, tiny_sd, instance_dir,
                                                                        class_dir) -> None:
    """SIGTERM sent to rank 1 alone (a scheduler that signals one node): rank 0 learns of it in the step's
    collective and both stop after the same step with one checkpoint, instead of rank 1 saving alone
    while rank 0 waits for it in the next step."""
    proc = start_until_both_ranks_train(tmp_path, {**ENDLESS, "checkpoints_dir": str(tmp_path / "ckpt")},
                                        (tiny_sd, instance_dir, class_dir))
    try:
        (rank1,) = [p for p in psutil.Process(proc.pid).children(recursive=True)
                    if p.environ().get("OMPI_COMM_WORLD_RANK") == "1" and "tasks.train" in " ".join(p.cmdline())]
        rank1.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=240)[1]
    finally:
        _kill_tree(proc.pid)
    stops = [line.split("interrupted by SIGTERM after step ")[1].split(";")[0]
             for line in rest.splitlines() if "interrupted by SIGTERM after step" in line]
    assert len(stops) == 2 and stops[0] == stops[1], rest[-3000:]
    assert proc.returncode != 0
    (checkpoint,) = (tmp_path / "ckpt").glob("*/checkpoint-*")
    assert checkpoint.name == f"checkpoint-{stops[0]}"
    assert {"random_states_0.pkl", "random_states_1.pkl"} <= {p.name for p in checkpoint.iterdir()}


def test_sigterm_reaches_every_rank_and_two_ranks_resume_exactly_with_buckets(tmp_path, tiny_sd, mixed_dir,
                                                                              class_dir) -> None:
    """SIGTERM to `python -m tasks.train` goes through mpirun to both ranks: they save one checkpoint
    together (each its RNG file) wherever they are in the epoch, the stage exits 143, and the next
    2-rank run continues from it. With aspect-ratio buckets, the stopped run resumed to k + 2 steps
    equals k + 2 straight steps bit for bit (a constant LR: the stopped run's endless
    max_train_steps would otherwise shape a decaying schedule differently)."""
    section = {**ENDLESS, "lr_scheduler": "constant", "enable_bucket": True, "min_bucket_reso": 16,
               "max_bucket_reso": 64, "bucket_reso_steps": 8, "checkpoints_dir": str(tmp_path / "ckpt_b")}
    inputs = (tiny_sd, mixed_dir, class_dir)
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    proc = start_until_both_ranks_train(tmp_path / "b", section, inputs)
    try:
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=240)[1]
    finally:
        _kill_tree(proc.pid)
    assert proc.returncode == 128 + signal.SIGTERM, rest[-3000:]
    assert "error: stopped by SIGTERM, passed to every rank" in rest and rest.count("interrupted by SIGTERM") == 2
    (checkpoint,) = (tmp_path / "ckpt_b").glob("*/checkpoint-*")
    assert {"random_states_0.pkl", "random_states_1.pkl"} <= {p.name for p in checkpoint.iterdir()}
    stopped_at = int(checkpoint.name.split("-")[1])

    resumed = run_stage(tmp_path / "b", {**section, "max_train_steps": stopped_at + 2}, inputs)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    report = json.loads((tmp_path / "b" / "train.json").read_text())
    assert report["resumed_from_step"] == stopped_at and report["steps"] == stopped_at + 2
    assert report["buckets"] == {"24x40": 3, "32x32": 1, "40x24": 2}
    straight = run_stage(tmp_path / "a", {**section, "max_train_steps": stopped_at + 2, "resume": "none",
                                          "checkpoints_dir": str(tmp_path / "ckpt_a")}, inputs)
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert _csv_losses(tmp_path / "b" / "loss.csv") == _csv_losses(tmp_path / "a" / "loss.csv")
    a, b = load_file(tmp_path / "a" / "out" / UNET), load_file(tmp_path / "b" / "out" / UNET)
    assert all(torch.equal(a[k], b[k]) for k in a), "bit-identical weights after the 2-rank resume"


def test_two_ranks_select_the_best_checkpoint_of_a_diverging_run(tmp_path, tiny_sd, instance_dir, class_dir) -> None:
    """Rank 0 scores each checkpoint and every rank gets the record: when the loss turns NaN, both
    ranks stop (none fails on its own) and the best healthy checkpoint is the output."""
    section = {**SETTINGS, "max_train_steps": 8, "learning_rate": 1.0, "lr_scheduler": "constant",
               "train_batch_size": 1, "with_prior_preservation": False, "num_validation_images": 1,
               "validation_inference_steps": 2, "select_checkpoint": "best", "checkpointing_steps": 2,
               "checkpoints_total_limit": 1, "checkpoints_dir": str(tmp_path / "ckpt"),
               "launcher": "mpirun", "launch": {"num_processes": 2, "threads_per_process": 1}}
    done = run_stage(tmp_path, section, (tiny_sd, instance_dir, class_dir))
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads((tmp_path / "train.json").read_text())
    selected, scored = report["selected_checkpoint"], {r["step"]: r for r in report["checkpoints"]}
    assert "loss became nan" in selected["stopped_early"] and scored and max(scored) < 8
    best = max((r for r in scored.values() if not r["collapsed"]), key=lambda r: r[selected["metric"]])
    assert selected["step"] == best["step"] and selected["select"] == "best"
    saved = load_file(tmp_path / "out" / UNET)
    assert best["kept"], "the best checkpoint is kept beyond checkpoints_total_limit"
    chosen = load_file(Path(best["path"]) / "trainable_unet.safetensors")
    assert all(torch.equal(saved[k], chosen[k]) for k in chosen), "the output is the chosen checkpoint's weights"
