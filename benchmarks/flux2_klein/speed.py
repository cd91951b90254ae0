"""The export's reason to exist at real size: seconds per image of the compressed OpenVINO export
against the PyTorch pipeline (bf16, and on the int8 base), same prompt, size, steps and starting
latents, and the PSNR between their images.

    .venv/bin/python -m benchmarks.flux2_klein.chain                 # once: the chain's work clone
    .venv/bin/python -m benchmarks.flux2_klein.speed                 # results_speed.json

It reads the chain's outputs in `--work`: models/openvino (the int8 export, static at its size),
models/base and models/finetuned (the LoRA, unfused). Each backend runs in a process of its own
(peak RSS its own, measured as chain.py measures a stage):
- `openvino`: the export as evaluate and the registry load it (its openvino_runtime.json precision);
- `pytorch_bf16`: diffusers' pipeline in bf16 (the release's dtype), the LoRA loaded unfused;
- `pytorch_int8`: the same with the transformer and text encoder quantized to int8 as they load
  (diffusers' torchao config, as the registered version's diffusers backend loads a referenced base).
Each loads, makes one 1-step image (warm-up, not timed), then `--images` images at `--steps`, timed.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
MODES = ("openvino", "pytorch_bf16", "pytorch_int8")
PROMPT = "a photo of sks dog"


def _pipeline(mode: str, work: Path):
    """The backend's pipeline and its family."""
    import torch

    from tasks.common import families

    if mode == "openvino":
        from tasks.common.openvino_model import load_ov_pipeline

        pipe = load_ov_pipeline(work / "models/openvino", static=True)
        return pipe, families.of_pipeline(pipe)
    from diffusers import DiffusionPipeline

    from finetune_runtime.base_reference import quantization
    from tasks.register.core import base_precision

    base = str(work / "models/base")
    kwargs = {"torch_dtype": torch.bfloat16}
    if mode == "pytorch_int8":  # what the registered version's diffusers backend loads
        kwargs.update(quantization(base_precision(Path(base), {"base_model_precision": "int8",
                                                               "text_encoder_precision": "int8"})))
    pipe = DiffusionPipeline.from_pretrained(base, **kwargs)
    pipe.load_lora_weights(work / "models/finetuned", weight_name="pytorch_lora_weights.safetensors")
    return pipe, families.of_pipeline(pipe)


def run_one(mode: str, work: Path, size: int, steps: int, images: int, out: Path) -> None:
    """One backend: load, warm up, time `images` images; their pixels to `out`.npy, figures to stdout."""
    import numpy as np
    import torch

    start = time.monotonic()
    pipe, family = _pipeline(mode, work)
    pipe.set_progress_bar_config(disable=True)
    load_s = time.monotonic() - start
    shape = family.denoiser.latent_shape(pipe, size, size)

    def image(seed: int, n_steps: int) -> np.ndarray:
        latents = torch.randn((1, *shape), generator=torch.Generator().manual_seed(seed))
        return np.asarray(family.generate(pipe, [PROMPT], steps=n_steps, latents=latents, height=size, width=size,
                                          guidance=4.0, output_type="np"))[0]

    image(0, 1)
    seconds, made = [], []
    for seed in range(images):
        start = time.monotonic()
        made.append(image(seed, steps))
        seconds.append(round(time.monotonic() - start, 2))
    np.save(out, np.stack(made).astype(np.float32))
    print(json.dumps({"load_s": round(load_s, 1), "seconds_per_image": seconds}))


def main() -> None:
    from benchmarks.flux2_klein.chain import measured

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=ROOT / ".cache/bench/flux2-klein-chain")
    parser.add_argument("--results", type=Path, default=HERE / "results_speed.json")
    parser.add_argument("--size", type=int, default=256, help="px; the export's static size")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--images", type=int, default=2)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--floor-gb", type=float, default=0.8)
    parser.add_argument("--one", choices=MODES, help=argparse.SUPPRESS)  # the child process
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        run_one(args.one, args.work, args.size, args.steps, args.images, args.out)
        return
    import numpy as np

    from tasks.common.psnr import psnr_db

    if not (args.work / "models/openvino/model_index.json").is_file():
        raise SystemExit(f"{args.work}/models/openvino is missing: run `python -m benchmarks.flux2_klein.chain` first")
    rows, pixels = {}, {}
    for mode in args.modes:
        out = args.work / f"speed-{mode}.npy"
        argv = [sys.executable, "-m", "benchmarks.flux2_klein.speed", "--one", mode, "--out", str(out),
                "--work", str(args.work.resolve()), "--size", str(args.size), "--steps", str(args.steps),
                "--images", str(args.images)]
        row = measured(argv, ROOT, args.work / f"speed-{mode}.log", args.floor_gb)
        if row["rc"] == 0:
            row.update(json.loads((args.work / f"speed-{mode}.out").read_text().strip().splitlines()[-1]))
            pixels[mode] = np.load(out)
        print(json.dumps({"mode": mode, **row}), flush=True)
        rows[mode] = row
    psnr = {f"{a}_vs_{b}": [round(psnr_db(x, y), 2) for x, y in zip(pixels[a], pixels[b])]
            for i, a in enumerate(MODES) for b in MODES[i + 1:] if a in pixels and b in pixels}
    args.results.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "size": args.size, "steps": args.steps,
                                        "images": args.images, "prompt": PROMPT, "modes": rows,
                                        "psnr_db": psnr}, indent=1) + "\n")


if __name__ == "__main__":
    main()
