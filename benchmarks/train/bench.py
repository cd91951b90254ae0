"""Training speed and memory: our loop against a plain seed-style loop, on the same data and settings.

    python benchmarks/train/bench.py matrix                   # everything in README.md, subprocess per cell
    python benchmarks/train/bench.py one --model sd15 --method lora --loop ours   # one cell, JSON on stdout

Models: `tiny` is the built-in tiny SD at 64 px; `sd15` is the Stable Diffusion 1.5 architecture
(UNet 860M, VAE 84M, CLIP ViT-L/14 text encoder 123M; configs are public facts) with seeded random
weights at 256 px, built once into .cache/bench/ (4.3 GB). Speed does not depend on weight values.

Loops:
- `plain`: written the way the seeds (diffusers' example scripts) write it: VAE and text encoder
  run every step, fp32, no caching, default memory format, torch's default AdamW, clipping, EMA;
  `plain-fused` changes only the optimizer to torch's fused AdamW (which our loop uses).
- `ours`: tasks.train.loop.run_loop with latent and text-embedding caching, bf16 autocast and
  channels_last; `ours-fp32`, `ours-bf16`, `ours-nocache` switch changes off to say which gave what.
Each cell runs in its own process, so peak RSS (ru_maxrss) is that cell's alone.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
CACHE = REPO / ".cache" / "bench"
METHOD_NAMES = ["dreambooth", "textual_inversion", "lora", "full"]
VARIANTS = {  # loop -> (cache, bf16, channels_last)
    "plain": None,
    "plain-fused": None,  # the seeds' loop with only the optimizer changed to torch's fused AdamW
    "ours-fp32": (True, False, False),
    "ours-bf16": (True, True, False),
    "ours-nocache": (False, True, True),
    "ours": (True, True, True),
}
RESOLUTION = {"tiny": 64, "sd15": 256}


def base_for(model: str) -> Path:
    from tasks.common.families import build_tiny_pipeline

    if model == "tiny":
        out = CACHE / "tiny-sd"
        return out if (out / "model_index.json").is_file() else build_tiny_pipeline("builtin:tiny-sd", 0, out)
    from benchmarks.export.sd15_random import build_sd15  # the export benchmark's SD 1.5 architecture

    out = CACHE / "sd15-arch"
    return out if (out / "model_index.json").is_file() else build_sd15(out)


def make_data(root: Path) -> tuple[Path, Path]:
    """2 instance and 2 class images at 512 px (resize and crop cost included, as in a real run)."""
    from tests.train.conftest import write_imagefolder

    return (write_imagefolder(root / "instance", 2, "a photo of sks toy", 0, size=(512, 512)),
            write_imagefolder(root / "class", 2, "a photo of a toy", 1, size=(512, 512)))


def config(method: str, model: str, variant: str, steps: int):
    from tasks.train.config import TrainConfig

    cache, bf16, channels_last = VARIANTS[variant] or (False, False, False)
    kw = dict(method=method, resolution=RESOLUTION[model], train_batch_size=1, max_train_steps=steps,
              learning_rate=1e-5, num_validation_images=0, cache_latents=cache, cache_text_encoder_outputs=cache,
              mixed_precision="bf16" if bf16 else "no", channels_last=channels_last, checkpointing_steps=10**6)
    if method == "textual_inversion":
        kw.update(placeholder_token="<sks>", initializer_token="toy", with_prior_preservation=False,
                  learning_rate=5e-3)
    if method == "full":
        kw.update(use_ema=True, snr_gamma=5.0, with_prior_preservation=False, caption_column="text")
    return TrainConfig(**kw)


def plain_loop(cfg, base: Path, data: Path, class_dir: Path, steps: int, fused: bool = False) -> list[float]:
    """The seeds' loop: every step encodes images and prompts in fp32; nothing is cached."""
    import torch
    import torch.nn.functional as F
    from diffusers.training_utils import EMAModel, compute_snr

    from tasks.train.loop import build_dataloader
    from tasks.train.methods import METHODS
    from tasks.train.models import load_components
    from tasks.train.optim import make_lr_scheduler

    torch.manual_seed(cfg.seed)
    method = METHODS[cfg.method](cfg)
    dataset = method.dataset(data, class_dir)
    c = load_components(base)
    method.bind(c)
    method.configure()
    params = [p for g in method.param_groups() for p in g["params"]]
    optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                  weight_decay=cfg.adam_weight_decay, eps=cfg.adam_epsilon,
                                  **({"fused": True} if fused else {}))  # the seeds: the default implementation
    lr_scheduler = make_lr_scheduler(cfg, optimizer, 1)
    ema = EMAModel(params, decay=cfg.ema_decay) if cfg.use_ema else None
    loader, _ = build_dataloader(dataset, method, cfg)
    times: list[float] = []
    while len(times) < steps:
        for batch in loader:
            start = time.perf_counter()
            latents = c.vae.encode(batch.pixels).latent_dist.sample() * c.vae.config.scaling_factor
            noise = torch.randn_like(latents)
            timesteps = torch.randint(0, c.noise_scheduler.config.num_train_timesteps, (latents.shape[0],))
            noisy = c.noise_scheduler.add_noise(latents, noise, timesteps)
            hidden, pooled = c.family.text.encode_prompt(c, batch.input_ids)
            pred = c.family.denoiser.predict(c.denoiser, noisy, timesteps, hidden, pooled,
                                             batch.predict_inputs(cfg.resolution, cfg.guidance_scale))
            n = batch.num_instances
            if cfg.snr_gamma:
                snr = compute_snr(c.noise_scheduler, timesteps)
                weights = torch.stack([snr, cfg.snr_gamma * torch.ones_like(timesteps)], dim=1).min(dim=1)[0] / snr
                loss = (F.mse_loss(pred, noise, reduction="none").mean(dim=[1, 2, 3]) * weights).mean()
            elif n < pred.shape[0]:
                loss = F.mse_loss(pred[:n], noise[:n]) + cfg.prior_loss_weight * F.mse_loss(pred[n:], noise[n:])
            else:
                loss = F.mse_loss(pred, noise)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            method.after_step()
            if ema is not None:
                ema.step(params)
            times.append(time.perf_counter() - start)
            if len(times) >= steps:
                break
    return times


def our_loop(cfg, base: Path, data: Path, class_dir: Path) -> list[float]:
    from accelerate.utils import set_seed

    from tasks.train.loop import make_accelerator, run_loop
    from tasks.train.methods import METHODS
    from tasks.train.models import load_components

    accelerator = make_accelerator(cfg)
    set_seed(cfg.seed)
    method = METHODS[cfg.method](cfg)
    dataset = method.dataset(data, class_dir)
    method.bind(load_components(base))
    result = run_loop(method, dataset, cfg, accelerator)
    return [h.seconds for h in result.history]


def memory_needed_gb(model: str, method: str) -> float:
    """A rough floor for a cell: fp32 weights, and for full-UNet methods grads + AdamW moments (+ EMA)."""
    if model != "sd15":
        return 1.0
    unet, rest = 3.44, 0.83  # GB of fp32 weights: UNet 860M; VAE 84M + CLIP 123M
    if method in ("dreambooth", "full"):
        return unet * (4 + (method == "full")) + rest + 2.5  # + activations at 256 px, batch 2
    return unet + rest + 2.5


def one(model: str, method: str, loop: str, steps: int, warmup: int) -> dict:
    """Measure one cell in this process (or say why not: this machine is shared, never OOM it)."""
    import resource

    import psutil
    import torch

    need, free = memory_needed_gb(model, method), psutil.virtual_memory().available / 2**30
    if free < need:
        return {"model": model, "method": method, "loop": loop,
                "error": f"skipped: needs about {need:.1f} GB of RAM, {free:.1f} GB available"}
    base = base_for(model)
    with tempfile.TemporaryDirectory() as tmp:
        data, class_dir = make_data(Path(tmp))
        cfg = config(method, model, loop, warmup + steps)
        start = time.perf_counter()
        times = (plain_loop(cfg, base, data, class_dir, warmup + steps, fused=loop == "plain-fused")
                 if loop.startswith("plain") else our_loop(cfg, base, data, class_dir))
        wall = time.perf_counter() - start
    timed = times[warmup:]
    images = cfg.train_batch_size * (2 if cfg.with_prior_preservation else 1)
    median = statistics.median(timed)
    return {"model": model, "method": method, "loop": loop, "resolution": cfg.resolution, "warmup": warmup,
            "images_per_step": images, "median_step_s": round(median, 4), "images_per_s": round(images / median, 3),
            "step_s": [round(t, 4) for t in times], "peak_rss_mb": round(
                resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            "wall_s": round(wall, 1), "threads": torch.get_num_threads(), "load_avg": os.getloadavg()}


def matrix(models: list[str], methods: list[str], loops: list[str], steps: int, warmup: int, out: Path) -> None:
    results = [r for r in (json.loads(out.read_text()) if out.is_file() else []) if "error" not in r]
    done = {(r["model"], r["method"], r["loop"]) for r in results}  # failed or skipped cells run again
    for model in models:
        for method in methods:
            for loop in loops:
                if (model, method, loop) in done:
                    continue
                # The tiny model's steps are short and noisy on a shared machine: time more of them.
                n = max(steps, 20) if model == "tiny" else steps
                cmd = [sys.executable, __file__, "one", "--model", model, "--method", method, "--loop", loop,
                       "--steps", str(n), "--warmup", str(warmup)]
                print("running", " ".join(cmd[2:]), flush=True)
                proc = subprocess.run(cmd, capture_output=True, text=True)
                if proc.returncode != 0:
                    row = {"model": model, "method": method, "loop": loop,
                           "error": (proc.stderr.strip().splitlines() or ["?"])[-1][:300]}
                else:
                    row = json.loads(proc.stdout.strip().splitlines()[-1])
                print(json.dumps(row), flush=True)
                results.append(row)
                out.write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))


def table(results: list[dict]) -> str:
    """Markdown: median and fastest timed step (the fastest is the least disturbed by other work on
    a shared machine), images/s from the median, the ratio to the plain loop, peak RSS."""
    lines = ["| model | method | loop | median step s | fastest step s | images/s | vs plain | peak RSS MB |",
             "|---|---|---|---|---|---|---|---|"]
    plain = {(r["model"], r["method"]): r.get("images_per_s") for r in results if r["loop"] == "plain"}
    for r in results:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['method']} | {r['loop']} | {r['error']} | | | | |")
            continue
        ref = plain.get((r["model"], r["method"]))
        ratio = f"{r['images_per_s'] / ref:.2f}x" if ref else ""
        fastest = min(r["step_s"][r.get("warmup", 2):])
        lines.append(f"| {r['model']} | {r['method']} | {r['loop']} | {r['median_step_s']} | {fastest} "
                     f"| {r['images_per_s']} | {ratio} | {r['peak_rss_mb']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_one = sub.add_parser("one", help="one cell, JSON on stdout")
    p_one.add_argument("--model", choices=list(RESOLUTION), required=True)
    p_one.add_argument("--method", choices=METHOD_NAMES, required=True)
    p_one.add_argument("--loop", choices=list(VARIANTS), required=True)
    p_all = sub.add_parser("matrix", help="every cell, each in a subprocess; resumes a partial results file")
    p_all.add_argument("--models", nargs="+", default=["tiny", "sd15"])
    p_all.add_argument("--methods", nargs="+", default=METHOD_NAMES)
    p_all.add_argument("--loops", nargs="+", default=["plain", "ours"])
    p_all.add_argument("--out", type=Path, default=Path(__file__).with_name("results.json"))
    p_table = sub.add_parser("table", help="print the markdown table of a results file")
    p_table.add_argument("--out", type=Path, default=Path(__file__).with_name("results.json"))
    for p in (p_one, p_all):
        p.add_argument("--steps", type=int, default=3, help="timed steps")
        p.add_argument("--warmup", type=int, default=2, help="untimed first steps (fill the caches)")
    args = parser.parse_args()
    if args.cmd == "one":
        import logging

        logging.disable(logging.WARNING)
        print(json.dumps(one(args.model, args.method, args.loop, args.steps, args.warmup)))
    elif args.cmd == "matrix":
        matrix(args.models, args.methods, args.loops, args.steps, args.warmup, args.out)
    else:
        print(table(json.loads(args.out.read_text())))


if __name__ == "__main__":
    main()
