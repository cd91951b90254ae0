"""Many fine-tunes on one base: run-time adapters (OpenVINO GenAI) against fused exports.

    .venv/bin/python -m benchmarks.adapters.bench --counts 1 10 50 --size 256 --steps 4 --requests 12

On SD 1.5's architecture with random weights (benchmarks/export/sd15_random.py builds it into
`--base` when missing): the base exported once as `export.adapters: runtime` does it
(tasks/export/runtime.py), `max(counts)` rank-`--rank` LoRAs on the UNet's attention written in
GenAI's layout (tasks/common/genai.py), then, each in a fresh process so its memory is its own:

- `fused`: the base compiled with no adapter, what a fused export of any one fine-tune computes
  (same network, same weights' size), serving `--requests` requests;
- `runtime-N`: the base compiled with N adapters (MODE_DYNAMIC), every request naming another one.

Per mode: load + compile seconds, resident memory after loading and at peak, per-request latency
(median, p95), images/s, and the first request's latency. Bytes: a fused export per fine-tune
against an adapter per fine-tune (the registry stores the diffusers LoRA and GenAI's form).
Writes results.json beside this file (`--report`). `--compression int8` serves a base whose weights
NNCF compressed to 8 bit, as `export.compression.mode: int8` with run-time adapters writes it.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROMPT = "a photo of sks toy"


def rss_mb() -> float:
    """This process's resident memory now, MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            amx = " with AMX" if "amx_tile" in Path("/proc/cpuinfo").read_text() else ""
            return line.split(":", 1)[1].strip() + amx
    return platform.machine()


def make_adapters(base: Path, out: Path, count: int, rank: int) -> dict[str, float]:
    """`count` random LoRAs in GenAI's layout (and one in diffusers' for its size); MB each."""
    import torch
    from diffusers import StableDiffusionPipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    from tasks.common.genai import write_genai_lora

    out.mkdir(parents=True, exist_ok=True)
    pipe = StableDiffusionPipeline.from_pretrained(base)
    pipe.unet.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    lora = [p for n, p in pipe.unet.named_parameters() if "lora_" in n]
    for i in range(count):
        if (out / f"a{i}.safetensors").is_file():
            continue
        generator = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for p in lora:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.02)
        write_genai_lora(pipe, out / f"a{i}.safetensors")
    StableDiffusionPipeline.save_lora_weights(out / "diffusers", unet_lora_layers=get_peft_model_state_dict(pipe.unet))
    mb = 2 ** 20
    return {"genai_lora_mb": (out / "a0.safetensors").stat().st_size / mb,
            "diffusers_lora_mb": (out / "diffusers" / "pytorch_lora_weights.safetensors").stat().st_size / mb}


def serve(export: Path, adapters: list[Path], size: int, steps: int, requests: int) -> dict[str, float]:
    """One mode in this process: compile, then `requests` requests, adapter k % N for request k."""
    import openvino_genai as genai

    from tasks.common.genai import generate, load_text2image
    from tasks.common.openvino_model import StaticShape

    shape = StaticShape(1, size, size, 1)
    start = time.perf_counter()
    pipe = load_text2image(export, shape, 7.5, "f32", adapters)
    handles = [genai.Adapter(str(p)) for p in adapters]
    load_s, rss_loaded = time.perf_counter() - start, rss_mb()
    times = []
    for k in range(requests):
        chosen = [(handles[k % len(handles)], 1.0)] if handles else []
        start = time.perf_counter()
        generate(pipe, PROMPT, shape, steps, 7.5, k, chosen)
        times.append(time.perf_counter() - start)
    steady = sorted(times[1:])
    return {"load_compile_s": round(load_s, 2), "rss_loaded_mb": round(rss_loaded),
            "rss_peak_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            "first_request_s": round(times[0], 3), "median_s": round(statistics.median(steady), 3),
            "p95_s": round(steady[min(len(steady) - 1, int(0.95 * len(steady)))], 3),
            "images_per_s": round(len(steady) / sum(steady), 4)}


def _base_export(base: Path, work: Path, export: Path, compression: str) -> float:
    """The base (built when missing), its runtime export, and with `compression` its compressed
    copy in `export`; returns the seconds this took (0 when all were there)."""
    from tasks.common.outputs import link_tree
    from tasks.export.compress import compress_ir_weights
    from tasks.export.config import CompressionConfig
    from tasks.export.runtime import base_export

    if not (base / "model_index.json").is_file():
        from benchmarks.export.sd15_random import build_sd15

        build_sd15(base)
    start = time.perf_counter()
    f32 = work / "base"
    if not (f32 / "model_index.json").is_file():
        base_export(base, f32, Path(".cache/openvino-base"))
    if not (export / "model_index.json").is_file():
        link_tree(f32, export.with_suffix(".tmp"))
        compress_ir_weights(export.with_suffix(".tmp"), CompressionConfig(mode=compression))
        export.with_suffix(".tmp").rename(export)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", type=Path, default=Path(".cache/bench/sd15-arch"))
    parser.add_argument("--work", type=Path, default=Path(".cache/bench/adapters"))
    parser.add_argument("--counts", type=int, nargs="+", default=[1, 10, 50])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--compression", choices=("none", "int8"), default="none",
                        help="int8: the base's weights compressed as export.compression.mode int8 does")
    parser.add_argument("--report", type=Path, default=HERE / "results.json")
    parser.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)  # child: N adapters
    args = parser.parse_args()
    export = args.work / ("base" if args.compression == "none" else f"base-{args.compression}")
    if args.serve is not None:
        files = [args.work / "loras" / f"a{i}.safetensors" for i in range(args.serve)]
        print(json.dumps(serve(export, files, args.size, args.steps, args.requests)))
        return
    from tasks.common.openvino_model import folder_size_mb

    export_s = _base_export(args.base, args.work, export, args.compression)
    sizes = make_adapters(args.base, args.work / "loras", max(args.counts), args.rank)
    base_mb = folder_size_mb(export)
    modes = {}
    # fused first and last: the first process after the export ran 38% slower here (cold caches)
    for name, n in [("fused", 0)] + [(f"runtime-{n}", n) for n in args.counts] + [("fused-rerun-last", 0)]:
        cmd = [sys.executable, "-m", "benchmarks.adapters.bench", "--work", str(args.work), "--serve", str(n),
               "--compression", args.compression,
               "--size", str(args.size), "--steps", str(args.steps), "--requests", str(args.requests)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        modes[name] = json.loads(done.stdout.strip().splitlines()[-1])
        print(name, modes[name], flush=True)
    per_tune_mb = sizes["genai_lora_mb"] + sizes["diffusers_lora_mb"]
    result = {
        "command": " ".join(sys.argv), "machine": cpu_name(),
        "cpus": os.cpu_count(), "size": args.size, "steps": args.steps, "requests": args.requests,
        "rank": args.rank, "compression": args.compression, "base_export_s": round(export_s, 1),
        "base_export_mb": round(base_mb, 1),
        **{k: round(v, 2) for k, v in sizes.items()},
        "bytes": {str(n): {"fused_mb": round(n * base_mb, 1), "runtime_mb": round(base_mb + n * per_tune_mb, 1),
                           "extra_tune_vs_fused_pct": round(100 * per_tune_mb / base_mb, 2)} for n in args.counts},
        "modes": modes,
    }
    args.report.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
