"""FLUX.1-dev (11.9B), FLUX.2 [klein] 4B, Z-Image (6B), Qwen-Image (20B), Sana (1.6B), LTX-Video (2B) LoRA steps, 24 GB.

    .venv/bin/python -m benchmarks.flux_dev.build                                  # once: 32 GB folder
    .venv/bin/python -m benchmarks.flux_dev.train --precision int8 --steps 5       # appends to results.json
    .venv/bin/python -m benchmarks.flux_dev.train --table
    .venv/bin/python -m benchmarks.flux2_klein.build                               # once: 15 GB (GiB) folder
    .venv/bin/python -m benchmarks.flux_dev.train --model flux.2-klein-4b --precision int8 --text-precision int8
    .venv/bin/python -m benchmarks.zimage.build                                    # once: 20 GB (GiB) folder
    .venv/bin/python -m benchmarks.flux_dev.train --model z-image-6b --precision int8 --text-precision int8
    .venv/bin/python -m benchmarks.qwenimage.build                                 # once: 53 GB (GiB) folder
    .venv/bin/python -m benchmarks.flux_dev.train --model qwen-image --precision nf4 --text-precision int8
    .venv/bin/python -m benchmarks.sana.build                                      # once: 8.4 GB (GiB) folder
    .venv/bin/python -m benchmarks.flux_dev.train --model sana-1600m --precision int8
    .venv/bin/python -m benchmarks.ltx.build                                       # once: 13.2 GiB folder
    .venv/bin/python -m benchmarks.flux_dev.train --model ltx-2b --precision int8 --frames 25

One process runs `python -m tasks.train` (the DVC stage's command) on 4 images of 512 px trained at
256 px: LoRA rank 16 on the attention projections, `base_model_precision` (int8 = torchao weight-only),
`gradient_checkpointing`, `max_sequence_length` 128, bf16 autocast, batch 1, latents and prompts
cached, `fuse_lora: false` (the adapters and the pinned base reference are the output);
`--text-precision`: the text encoders quantized as they load for the text cache. The step
timer (benchmarks/steptimer.py) gives s/step after the warm-up and the peak RSS at the last step and
at exit; the memory log (`flux-memory.log` in the work folder) has the RSS at every log record, so
each phase's peak is in it. A video model (LTX-Video) trains on clips instead: synthetic mp4s
(--clips of them, 4 s at 24 fps and 256 px) through the ingest stage (`python -m tasks.ingest`,
`type: clips`, sampled at 8 fps to --frames frames at --resolution), captions from their sidecars.
Afterwards the saved LoRA file is loaded into the model's transformer
(its base weights allocated, never written, so they take no memory) with diffusers' own loader,
and its tensors compared with the file's. Results go to the model's own folder
(benchmarks/flux_dev/results.json, benchmarks/flux2_klein/results.json, benchmarks/zimage/results.json,
benchmarks/qwenimage/results.json, benchmarks/sana/results.json, benchmarks/ltx/results.json).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

from benchmarks.sd35.train import PROMPT, make_images
from benchmarks.steptimer import add_run_arguments, compute_precision, mixed_precision, summary, timed

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

#: Each model: its diffusers classes, its folder (built by its benchmark's build.py) and results.
MODELS = {
    "flux.1-dev": dict(pipeline="FluxPipeline", transformer="FluxTransformer2DModel", folder="flux1-dev",
                       benchmark=HERE),
    "flux.2-klein-4b": dict(pipeline="Flux2KleinPipeline", transformer="Flux2Transformer2DModel",
                            folder="flux2-klein-4b", benchmark=HERE.parent / "flux2_klein"),
    "z-image-6b": dict(pipeline="ZImagePipeline", transformer="ZImageTransformer2DModel", folder="z-image-6b",
                       benchmark=HERE.parent / "zimage"),
    "sana-1600m": dict(pipeline="SanaPipeline", transformer="SanaTransformer2DModel", folder="sana-1600m",
                       benchmark=HERE.parent / "sana", script="train_dreambooth_lora_sana.py"),
    "qwen-image": dict(pipeline="QwenImagePipeline", transformer="QwenImageTransformer2DModel", folder="qwen-image",
                       benchmark=HERE.parent / "qwenimage"),
    "ltx-2b": dict(pipeline="LTXPipeline", transformer="LTXVideoTransformer3DModel", folder="ltx-2b",
                   benchmark=HERE.parent / "ltx", clips=True),
}


def theirs_command(base: Path, work: Path, data: Path, args: argparse.Namespace, model: dict) -> list[str]:
    """diffusers' own script for the model (v<installed>, unchanged; benchmarks/diffusers_scripts.py fetches
    it) at the same settings: LoRA rank 16 on the script's default targets, bf16 (its base is never
    quantized), checkpointing, the same resolution, steps, learning rate and text length, no validation."""
    from benchmarks.diffusers_scripts import script

    return [str(script(model["script"])), "--pretrained_model_name_or_path", str(base),
            "--instance_data_dir", str(data), "--instance_prompt", PROMPT, "--output_dir", str(work / "theirs-out"),
            "--resolution", str(args.resolution), "--center_crop", "--train_batch_size", "1",
            "--max_train_steps", str(args.steps), "--learning_rate", "1e-4", "--lr_scheduler", "constant",
            "--mixed_precision", mixed_precision(compute_precision(args.compute)), "--rank", str(args.rank),
            "--gradient_checkpointing",
            "--max_sequence_length", str(args.max_sequence_length), "--checkpointing_steps", str(10 ** 6),
            "--seed", "0", "--report_to", "mlflow"]


def make_clips(work: Path, n: int, args: argparse.Namespace) -> Path:
    """`n` synthetic mp4s (H.264, 4 s at 24 fps, --resolution square: a seeded 8x8 grid of coloured blocks
    scrolling diagonally, a caption beside each) through the ingest stage as a user runs it, sampled at 8 fps to
    --frames frames; the stage's output folder (clips.jsonl and the frame folders)."""
    import av
    import numpy as np

    raw = work / "raw-clips"
    raw.mkdir()
    size, fps, seconds = args.resolution, 24, 4
    for i in range(n):
        rng = np.random.default_rng(i)
        blocks = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8).repeat(size // 8, 0).repeat(size // 8, 1)
        with av.open(str(raw / f"clip{i}.mp4"), "w") as out:
            stream = out.add_stream("libx264", rate=fps)
            stream.width = stream.height = size
            stream.pix_fmt = "yuv420p"
            for t in range(fps * seconds):
                frame = np.roll(blocks, shift=(2 * t, 3 * t), axis=(0, 1))
                out.mux(stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")))
            out.mux(stream.encode())
        (raw / f"clip{i}.txt").write_text(f"{PROMPT}, clip {i}")
    ingest = dict(data_dir=str(raw), sources=[{"type": "clips"}],
                  video={"frames": [args.frames], "fps": 8.0, "resolution": args.resolution})
    params = work / "ingest-params.yaml"
    params.write_text(yaml.safe_dump({"ingest": ingest}))
    processed = work / "processed"
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{work / 'mlflow.db'}", "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-m", "tasks.ingest", "--out", str(processed), "--report",
                    str(work / "ingest.json"), "--rejected", str(work / "ingest_rejected.jsonl"), "--params",
                    str(params)], cwd=work, env=env, check=True)
    return processed


def ours_command(base: Path, work: Path, data: Path, args: argparse.Namespace, clips: bool = False) -> list[str]:
    train = dict(
        method="lora", instance_prompt=PROMPT, with_prior_preservation=False, resolution=args.resolution,
        train_batch_size=1, max_train_steps=args.steps, learning_rate=1e-4, rank=args.rank,
        mixed_precision=mixed_precision(compute_precision(args.compute)), base_model_precision=args.precision,
        text_encoder_precision=args.text_precision,
        gradient_checkpointing=True, max_sequence_length=args.max_sequence_length,
        fuse_lora=False, checkpointing_steps=10 ** 6, validation_prompts=[], num_validation_images=0,
        validation_steps=0, checkpoints_dir=str(work / "checkpoints"), resume="none", seed=0,
    )
    if clips:
        train["caption_column"] = "text"  # the clips' sidecar captions, as clips.jsonl holds them
    params = work / "params.yaml"
    params.write_text(yaml.safe_dump({"train": train}))
    (work / "empty-class").mkdir(exist_ok=True)
    return ["-m", "tasks.train", "--base", str(base), "--data", str(data), "--class-data", str(work / "empty-class"),
            "--out", str(work / "out"), "--report", str(work / "report.json"),
            "--plot", str(work / "loss.csv"), "--params", str(params)]


def adapters_load(base: Path, out: Path, model: dict) -> dict:
    """Load the saved LoRA with diffusers' loader into the model's transformer whose base weights are
    allocated but never written (`to_empty`: untouched pages cost no memory), and count the adapter
    tensors that hold one of the file's tensors exactly (in the base's bf16, as the loader casts them)."""
    import diffusers
    import torch
    from accelerate import init_empty_weights
    from safetensors.torch import load_file

    pipeline, transformer_cls = getattr(diffusers, model["pipeline"]), getattr(diffusers, model["transformer"])
    with init_empty_weights():
        transformer = transformer_cls.from_config(transformer_cls.load_config(base / "transformer"))
    transformer = transformer.to(torch.bfloat16).to_empty(device="cpu")
    if model["pipeline"] == "FluxPipeline":  # FLUX.1's loader also reads kohya-style alphas
        state, alphas = pipeline.lora_state_dict(out, return_alphas=True)
        pipeline.load_lora_into_transformer(state, network_alphas=alphas, transformer=transformer)
    else:
        pipeline.load_lora_into_transformer(pipeline.lora_state_dict(out), transformer=transformer)
    loaded = [p.detach() for n, p in transformer.named_parameters() if "lora_" in n]
    saved = list(load_file(out / "pytorch_lora_weights.safetensors").values())
    equal = sum(1 for p in loaded if any(t.shape == p.shape and torch.equal(p, t.to(p.dtype)) for t in saved))
    return {"lora_tensors_in_file": len(saved), "lora_tensors_loaded": len(loaded), "lora_tensors_equal": equal,
            "lora_parameters": sum(p.numel() for p in loaded)}


def table(results: list[dict]) -> str:
    rows = ["| loop | base | steps timed | s/step median (min-max) | loss | peak RSS at last step, GB "
            "| peak RSS at exit, GB | adapters loaded |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        s = r["step_seconds"]
        losses = ", ".join(f"{x:.3f}" for x in r.get("losses", [])) or "(not recorded)"
        rows.append(f"| {r.get('loop', 'ours')} | {r['precision']} | {r['steps_timed']} | "
                    f"{r['s_per_step']:.1f} ({min(s):.1f}-{max(s):.1f}) | {losses} | {r['peak_rss_train_gb']:.1f} | "
                    f"{r['peak_rss_gb']:.1f} | {r['adapters']['lora_tensors_equal']}/"
                    f"{r['adapters']['lora_tensors_in_file']} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=list(MODELS), default="flux.1-dev")
    parser.add_argument("--base", type=Path, help="the model's folder (default .cache/bench/<its folder>)")
    parser.add_argument("--work", type=Path, help="default .cache/bench/<its folder>-train")
    parser.add_argument("--precision", default="int8")
    parser.add_argument("--text-precision", default="none", help="train.text_encoder_precision")
    parser.add_argument("--resolution", type=int, default=256)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--max-sequence-length", type=int, default=128)
    parser.add_argument("--frames", type=int, default=25, help="frames per clip (a video model)")
    parser.add_argument("--clips", type=int, default=3, help="synthetic clips (a video model)")
    add_run_arguments(parser, None)
    parser.add_argument("--loop", choices=("ours", "theirs"), default="ours",
                        help="theirs: diffusers' script for the model (where MODELS names one), bf16 base")
    parser.add_argument("--summarize", action="store_true", help="report on the work folder's finished run, "
                        "running nothing")
    args = parser.parse_args()
    model = MODELS[args.model]
    args.results = args.results or model["benchmark"] / "results.json"
    args.base = args.base or ROOT / ".cache/bench" / model["folder"]
    args.work = args.work or ROOT / ".cache/bench" / f"{model['folder']}-train"
    if args.table:
        print(table(json.loads(args.results.read_text())))
        return
    args.base, args.work = args.base.resolve(), args.work.resolve()
    if not (args.base / "model_index.json").is_file():
        build = "benchmarks." + model["benchmark"].name + ".build"
        raise SystemExit(f"{args.base} is missing: run `.venv/bin/python -m {build} --out {args.base}`")
    if args.summarize:
        timing = summary(args.loop, args.work / f"{args.loop}-timing.json", args.warmup)
    else:
        shutil.rmtree(args.work, ignore_errors=True)
        args.work.mkdir(parents=True)
        if model.get("clips"):
            data = images = make_clips(args.work, args.clips, args)
        else:
            data, images = make_images(args.work, 4)  # an imagefolder for ours, the images alone for theirs
        env = {"MLFLOW_TRACKING_URI": f"sqlite:///{args.work / 'mlflow.db'}", "PYTHONPATH": str(ROOT),
               "STEPTIMER_MEMORY_LOG": str(args.work / "flux-memory.log")}
        command = (theirs_command(args.base, args.work, images, args, model) if args.loop == "theirs"
                   else ours_command(args.base, args.work, data, args, bool(model.get("clips"))))
        timing = timed(args.loop, command, args.work, args.warmup, env)
    results = json.loads(args.results.read_text()) if args.results.is_file() else []
    precision = args.precision if args.loop == "ours" else "none"  # diffusers' scripts hold a bf16 base
    row = {"model": args.model, "method": "lora", "precision": precision,
           "text_precision": args.text_precision, "resolution": args.resolution,
           "rank": args.rank, "max_sequence_length": args.max_sequence_length, "gradient_checkpointing": True,
           **({"frames": args.frames, "clips": args.clips} if model.get("clips") else {}),
           "batch": 1, "compute": compute_precision(args.compute), "date": time.strftime("%Y-%m-%d"), "cpu": _cpu(),
           "threads": os.cpu_count(), **timing}
    if args.loop == "ours":
        row.update(_stage_report(args.work))
    out = args.work / ("out" if args.loop == "ours" else "theirs-out")
    row["adapters"] = adapters_load(args.base, out, model)
    print(json.dumps(row), flush=True)
    results.append(row)
    args.results.write_text(json.dumps(results, indent=1) + "\n")


def _stage_report(work: Path) -> dict:
    """The train stage's losses and its own report's figures (quantized layers, peaks per phase)."""
    report = json.loads((work / "report.json").read_text())
    losses = [float(line.split(",")[1]) for line in (work / "loss.csv").read_text().splitlines()[1:]]
    keys = ("base_model_precision", "quantized_layers", "peak_rss_mb_by_phase", "text_cache_seconds",
            "latent_cache_seconds", "allocator", "steps", "text_encoder_precision")
    return {"losses": losses, "finite_loss": all(math.isfinite(x) for x in losses),
            "report": {k: report.get(k) for k in keys}}


def _cpu() -> str:
    with open("/proc/cpuinfo", encoding="utf-8") as fh:
        info = fh.read()
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "")
    return f"{name or platform.machine()}{' (AMX)' if 'amx_bf16' in info else ''}"


if __name__ == "__main__":
    main()
