"""The train stage's `fuse_lora` output on a large base: shard by shard against the whole pipeline in memory.

    .venv/bin/python -m benchmarks.sd35.build --out .cache/bench/sd35-medium
    .venv/bin/python -m benchmarks.fuse.run --base .cache/bench/sd35-medium --report benchmarks/fuse/results.json

A LoRA of `--rank` on every attention projection of the base's denoiser (the family's
`denoiser.lora_targets`, what `train.method: lora` adapts), with seeded random A and B, is fused by the LoRA
method's two paths, each in a process of its own: `complete_output` (tasks/common/stream_fuse.py,
one shard at a time) and `fuse_in_memory` (the whole pipeline loaded, diffusers' `fuse_lora`,
`save_pretrained`). Reported: wall seconds, the process's peak RSS (and its RSS before, with the
libraries imported), the bytes written, and the largest difference between the two outputs' fused
weights.
"""
from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.adapters.bench import cpu_name, rss_mb

MODES = ("stream", "memory")


def write_lora(base: Path, path: Path, rank: int, seed: int = 0) -> int:
    """A diffusers LoRA file for `base`'s denoiser; returns its layers. The denoiser is built on the
    meta device (no memory) for its Linear layers' shapes."""
    import diffusers
    import torch
    from safetensors.torch import save_file

    from tasks.common import families

    family = families.detect(base)
    config = json.loads((base / family.denoiser.name / "config.json").read_text())
    with torch.device("meta"):
        model = getattr(diffusers, config["_class_name"]).from_config(config)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and any(name.endswith(t) for t in family.denoiser.lora_targets):
            key = f"{family.denoiser.name}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, module.in_features, generator=generator) * 0.01
            tensors[f"{key}.lora_B.weight"] = torch.randn(module.out_features, rank, generator=generator) * 0.01
    meta = {f"{family.denoiser.name}.{k}": v for k, v in
            {"r": rank, "lora_alpha": rank, "target_modules": list(family.denoiser.lora_targets)}.items()}
    save_file(tensors, path, metadata={"format": "pt", "lora_adapter_metadata": json.dumps(meta)})
    return len(tensors) // 2


def one(mode: str, base: Path, out: Path) -> dict[str, float]:
    """The child: fuse `out`'s LoRA file into `base` by `mode`, as the train stage's LoRA method does."""
    from tasks.common import families
    from tasks.train.config import TrainConfig
    from tasks.train.methods.lora import LoRA

    method = LoRA(TrainConfig(method="lora"))
    method.fused_components = [families.detect(base).denoiser.name]
    before_gb = rss_mb() / 1024  # the libraries imported, before any weight is read
    start = time.perf_counter()
    (method.complete_output if mode == "stream" else method.fuse_in_memory)(base, out)
    return {"seconds": round(time.perf_counter() - start, 1),
            "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
            "rss_before_gb": round(before_gb, 2)}


def _written_gb(out: Path) -> float:
    """Bytes in files of `out` with one link (hard links to the base's files are not new bytes)."""
    return round(sum(p.stat().st_size for p in out.rglob("*") if p.is_file() and p.stat().st_nlink == 1) / 2**30, 2)


def _largest_difference(a: Path, b: Path, lora: Path) -> float:
    """The largest absolute difference between the two outputs' fused weights, one tensor at a time."""
    from safetensors import safe_open

    with safe_open(lora, "pt") as fh:
        component = next(iter(fh.keys())).split(".")[0]
    where = {}
    for file in (a / component).glob("*.safetensors"):
        with safe_open(file, "pt") as fh:
            where.update({k: file for k in fh.keys()})  # noqa: SIM118 (safe_open is not a dict)
    worst = 0.0
    for file in sorted((b / component).glob("*.safetensors")):
        with safe_open(file, "pt") as theirs:
            for key in theirs.keys():  # noqa: SIM118
                with safe_open(where[key], "pt") as mine:
                    diff = (mine.get_tensor(key).float() - theirs.get_tensor(key).float()).abs()
                worst = max(worst, float(diff.max()) if diff.numel() else 0.0)
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", type=Path, required=True)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--work", type=Path, default=Path(".cache/bench/fuse"))
    parser.add_argument("--report", type=Path, default=Path("benchmarks/fuse/results.json"))
    parser.add_argument("--one", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.base, args.work / args.one)))
        return
    shutil.rmtree(args.work, ignore_errors=True)
    rows: dict[str, dict[str, float]] = {}
    for mode in MODES:
        out = args.work / mode
        out.mkdir(parents=True)
        layers = write_lora(args.base, out / "pytorch_lora_weights.safetensors", args.rank)
        cmd = [sys.executable, "-m", "benchmarks.fuse.run", "--one", mode, "--base", str(args.base),
               "--work", str(args.work)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        rows[mode] = {**json.loads(done.stdout.strip().splitlines()[-1]), "written_gb": _written_gb(out)}
        print(mode, rows[mode], flush=True)
    lora = args.work / "stream" / "pytorch_lora_weights.safetensors"
    report = {"command": "python -m benchmarks.fuse.run " + " ".join(sys.argv[1:]), "cpu": cpu_name(),
              "base": str(args.base), "base_gb": round(sum(p.stat().st_size for p in args.base.rglob("*")
                                                          if p.is_file()) / 2**30, 2),
              "rank": args.rank, "lora_layers": layers, "modes": rows,
              "largest_difference": _largest_difference(args.work / "stream", args.work / "memory", lora)}
    args.report.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
