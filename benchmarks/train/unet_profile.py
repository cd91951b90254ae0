"""Where a textual-inversion step's time goes: the frozen bf16 UNet's forward and its backward to the
text embeddings, the part of the step that is the same work in our stage and in diffusers' script.

    .venv/bin/python -m benchmarks.train.unet_profile --resolution 512
    .venv/bin/python -m benchmarks.train.unet_profile --resolution 512 --sdpa math --no-channels-last
    .venv/bin/python -m benchmarks.train.unet_profile --resolution 512 --no-channels-last --against-compile 16

Times `--steps` steps (the first is a warm-up), then profiles one with torch.profiler and sums
its self CPU time into attention (SDPA's kernels), convolution, matmul (the linear layers) and the
rest. `--against-compile N` instead alternates N steps of the eager UNet with N of the same UNet
under torch.compile (compiled first, untimed) in one process, so a drift of the machine's speed
reaches both alike, and prints the ratio of each pair. Run it under tcmalloc as the stage does
(LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4).
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}
GROUPS = {"attention": ("scaled_dot_product", "flash_attention"), "convolution": ("convolution",),
          "matmul": ("aten::mm", "aten::addmm", "aten::bmm")}


def load_unet(base: Path, channels_last: bool) -> torch.nn.Module:
    from diffusers import UNet2DConditionModel

    unet = UNet2DConditionModel.from_pretrained(base, subfolder="unet", dtype=torch.bfloat16)
    unet.requires_grad_(False).train()
    return unet.to(memory_format=torch.channels_last) if channels_last else unet


def step(unet: torch.nn.Module, latents: torch.Tensor, sdpa: str) -> None:
    """One forward and backward, the gradient going only to the text embeddings (textual inversion)."""
    hidden = torch.randn(1, 77, unet.config.cross_attention_dim, requires_grad=True)
    with sdpa_kernel([BACKENDS[sdpa]]), torch.autocast("cpu", torch.bfloat16):
        out = unet(latents, torch.tensor([500]), encoder_hidden_states=hidden).sample
    torch.nn.functional.mse_loss(out.float(), latents.float()).backward()


def grouped(prof: profile) -> dict[str, float]:
    """Self CPU seconds per group of operators."""
    seconds = dict.fromkeys([*GROUPS, "rest"], 0.0)
    for event in prof.key_averages():
        group = next((g for g, keys in GROUPS.items() if any(k in event.key for k in keys)), "rest")
        seconds[group] += event.self_cpu_time_total / 1e6
    return seconds


def against_compile(unet: torch.nn.Module, latents: torch.Tensor, sdpa: str, pairs: int) -> None:
    compiled = torch.compile(unet)
    start = time.perf_counter()
    step(compiled, latents, sdpa)
    print(f"compile and first compiled step: {time.perf_counter() - start:.0f} s")
    step(unet, latents, sdpa)
    ratios = []
    for _ in range(pairs):
        seconds = []
        for module in (unet, compiled):
            start = time.perf_counter()
            step(module, latents, sdpa)
            seconds.append(time.perf_counter() - start)
        ratios.append(seconds[0] / seconds[1])
        print(f"eager {seconds[0]:.2f} s, compiled {seconds[1]:.2f} s: eager / compiled {ratios[-1]:.3f}")
    print(f"eager / compiled, median of {pairs} pairs: {statistics.median(ratios):.3f} "
          f"({min(ratios):.3f}-{max(ratios):.3f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path, default=ROOT / ".cache/bench/sd15-arch")
    parser.add_argument("--resolution", type=int, default=512)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--sdpa", choices=list(BACKENDS), default="flash")
    parser.add_argument("--no-channels-last", dest="channels_last", action="store_false")
    parser.add_argument("--against-compile", type=int, default=0, metavar="N")
    args = parser.parse_args()
    torch.manual_seed(0)
    unet = load_unet(args.base, args.channels_last)
    latents = torch.randn(1, 4, args.resolution // 8, args.resolution // 8, dtype=torch.bfloat16)
    if args.channels_last:
        latents = latents.contiguous(memory_format=torch.channels_last)
    if args.against_compile:
        against_compile(unet, latents, args.sdpa, args.against_compile)
        return
    seconds = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step(unet, latents, args.sdpa)
        seconds.append(time.perf_counter() - start)
    print(f"{args.resolution} px, sdpa {args.sdpa}, channels_last {args.channels_last}: s/step "
          f"{statistics.median(seconds[1:]):.2f} (after the warm-up: {', '.join(f'{s:.2f}' for s in seconds[1:])})")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(unet, latents, args.sdpa)
    groups = grouped(prof)
    total = sum(groups.values())
    print(f"profiled step, self CPU {total:.2f} s: " + ", ".join(
        f"{name} {s:.2f} s ({100 * s / total:.0f}%)" for name, s in groups.items()))


if __name__ == "__main__":
    main()
