"""Run a training script unchanged and record when each optimizer step ends, and its peak RSS.

    python benchmarks/steptimer.py OUT.json SCRIPT.py [args...]
    python benchmarks/steptimer.py OUT.json -m MODULE [args...]

Registers torch's global optimizer-step hook (every optimizer, whatever script built it), then runs
the script or module as __main__ in this process. At exit, OUT.json gets the step end times
(perf_counter seconds), the peak RSS at each step's end and at exit, and the wall time. Our stage
and diffusers' example scripts are timed by the same hook, so s/step means the same for both.
STEPTIMER_MEMORY_LOG=FILE also writes the current and peak RSS at every log record to FILE.
On a CUDA run it also records the peak of torch's CUDA allocator within each step (the peak is
reset at each step's end), and over the whole run. STEPTIMER_SDPA_DISABLE=cudnn,... turns off those
attention kernels of torch's for every loop alike (benchmarks/flux_dev/README.md: cuDNN's faulted).
`timed()` runs a command this way from a benchmark and summarises what it recorded.
"""
from __future__ import annotations

import argparse
import atexit
import json
import logging
import os
import resource
import runpy
import statistics
import subprocess
import sys
import time
from pathlib import Path


def _peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 ** 2  # KiB on Linux


def _rss_gb() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1024 ** 3


def _rss_parts_gb() -> str:
    """Anonymous memory (the heap, tensors) and file pages (mapped weights files) of the RSS."""
    with open("/proc/self/status") as fh:
        parts = {k: int(v.split()[0]) / 1024 ** 2 for k, v in (line.split(":", 1) for line in fh)
                 if k in ("RssAnon", "RssFile")}
    return f"anon {parts.get('RssAnon', 0):5.2f} file {parts.get('RssFile', 0):5.2f}"


def _log_memory(path: str) -> None:
    """The current and peak RSS with every log record the run makes, one line each, to `path`: where
    in a run the memory goes. A record factory, so the run's own logging set-up is left alone."""
    out = open(path, "w", encoding="utf-8")  # noqa: SIM115 - open for the process's life
    make = logging.getLogRecordFactory()

    def record(*args: object, **kwargs: object) -> logging.LogRecord:
        rec = make(*args, **kwargs)
        if rec.levelno >= logging.INFO:
            out.write(f"rss {_rss_gb():6.2f} GB ({_rss_parts_gb()})  peak {_peak_rss_gb():6.2f} GB  "
                      f"{rec.getMessage()[:160]}\n")
            out.flush()
        return rec

    logging.setLogRecordFactory(record)


def main() -> None:
    out, target, *rest = sys.argv[1:]
    start = time.perf_counter()
    ends: list[float] = []
    rss: list[float] = []
    faults: list[int] = []  # minor page faults so far (blocks the kernel had to map and zero): load-independent
    cuda: list[float] = []  # the CUDA allocator's peak since the last step's end (GB)
    cuda_peak = [0.0]

    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    def step_end(*_: object) -> None:
        ends.append(time.perf_counter())
        rss.append(_peak_rss_gb())
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
        if torch.cuda.is_initialized():
            cuda.append(torch.cuda.max_memory_allocated() / 1024 ** 3)
            cuda_peak[0] = max(cuda_peak[0], cuda[-1])
            torch.cuda.reset_peak_memory_stats()

    register_optimizer_step_post_hook(step_end)
    for backend in filter(None, os.environ.get("STEPTIMER_SDPA_DISABLE", "").split(",")):
        getattr(torch.backends.cuda, f"enable_{backend}_sdp")(False)  # one that faults (flux_dev/README.md)
    if os.environ.get("STEPTIMER_MEMORY_LOG"):
        _log_memory(os.environ["STEPTIMER_MEMORY_LOG"])

    def write() -> None:
        Path(out).write_text(json.dumps({
            "step_ends": [t - start for t in ends],
            "peak_rss_gb": _peak_rss_gb(),  # the whole process: loading, training, saving
            "peak_rss_at_step_gb": rss,  # the peak so far, at the end of each step
            "minor_faults_at_step": faults,
            **({"cuda_peak_at_step_gb": cuda, "cuda_peak_gb": max(
                cuda_peak[0], torch.cuda.max_memory_allocated() / 1024 ** 3)} if torch.cuda.is_initialized() else {}),
            "wall_seconds": time.perf_counter() - start,
        }))

    atexit.register(write)
    if target == "-m":
        module, *rest = rest
        sys.argv = [module, *rest]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [target, *rest]
        runpy.run_path(target, run_name="__main__")


def add_run_arguments(parser: argparse.ArgumentParser, results: Path | None) -> None:
    """The options both side-by-side benchmarks share: steps, warm-up, runs, results file, table."""
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per run, warm-up included")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--runs", type=int, default=1, help="ours then theirs, this many times per cell")
    parser.add_argument("--results", type=Path, default=results)
    parser.add_argument("--table", action="store_true", help="print the table of --results and exit")
    parser.add_argument("--compute", choices=["auto", "bf16", "fp32"], default="auto",
                        help="both sides' compute precision; auto: bf16 where this CPU computes it natively "
                             "(AVX512-BF16, AMX-BF16), fp32 where PyTorch emulates it (about 500x slower)")


def compute_precision(asked: str) -> str:
    """`bf16` or `fp32` for both sides of a benchmark: `auto` asks finetune_runtime/cpu_formats.py, as
    train.mixed_precision: auto does, so that neither side runs emulated bf16 on an AVX2-only CPU."""
    if asked != "auto":
        return asked
    from finetune_runtime.cpu_formats import detect

    return "bf16" if detect().bf16 else "fp32"


def mixed_precision(compute: str) -> str:
    """train.mixed_precision, and diffusers' scripts' --mixed_precision, for a compute precision."""
    return "bf16" if compute == "bf16" else "no"


def timed(name: str, command: list[str], work: Path, warmup: int, env: dict[str, str] | None = None) -> dict:
    """Run `command` (python arguments) under this timer in `work`; s/step is the median interval
    between optimizer steps after the first `warmup` steps."""
    out = work / f"{name}-timing.json"
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, str(out), *command], cwd=work, env={**os.environ, **(env or {})},
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return {**summary(name, out, warmup), "wall_s": round(time.perf_counter() - start, 1)}


def summary(name: str, out: Path, warmup: int) -> dict:
    """What `timed` reports, from the timing file a run wrote."""
    timing = json.loads(out.read_text())
    ends = timing["step_ends"]
    steps = [b - a for a, b in zip(ends, ends[1:])][warmup - 1:]  # intervals after the warm-up steps
    faults = timing.get("minor_faults_at_step", [])
    step_faults = [b - a for a, b in zip(faults, faults[1:])][warmup - 1:]
    return {"loop": name, "s_per_step": round(statistics.median(steps), 3), "steps_timed": len(steps),
            "step_seconds": [round(s, 3) for s in steps], "first_step_end_s": round(ends[0], 1),
            "peak_rss_train_gb": round(timing["peak_rss_at_step_gb"][-1], 2),
            "peak_rss_gb": round(timing["peak_rss_gb"], 2), "wall_s": round(timing["wall_seconds"], 1),
            "page_faults_per_step": int(statistics.median(step_faults)) if step_faults else None,
            "load_average": os.getloadavg()[0],
            **({"peak_cuda_steps_gb": round(max(timing["cuda_peak_at_step_gb"][warmup:], default=0.0), 2),
                "peak_cuda_gb": round(timing["cuda_peak_gb"], 2)} if "cuda_peak_gb" in timing else {})}


if __name__ == "__main__":
    main()
