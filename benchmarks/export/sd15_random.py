"""The export stage's four latencies on the real SD 1.5 architecture with random weights.

    .venv/bin/python -m benchmarks.export.sd15_random --steps 20 --mode full_int8 \
        --work /tmp/sd15-bench

Builds UNet2DConditionModel / AutoencoderKL / CLIPTextModel from SD 1.5's published config values
(no download; weights drawn from a seed, so the images are noise but every op and shape is SD
1.5's), saves the pipeline, and runs the export stage's own code (`tasks.export.core.export`) at
512 x 512, batch 1: PyTorch eager fp32, OpenVINO static at f32, then dynamic, static and compressed
at `--precision`, same prompt, seed, latents and steps, with image PSNR against fp32. Writes the
report.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import resource
import tempfile
import time
from pathlib import Path

log = logging.getLogger("benchmarks.export")


def build_sd15(out: Path, seed: int = 0) -> Path:
    """SD 1.5's architecture (runwayml/stable-diffusion-v1-5 configs) with seeded random weights."""
    import torch
    from diffusers import AutoencoderKL, PNDMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    from tasks.common.families.tiny import write_tokenizer

    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        sample_size=64, in_channels=4, out_channels=4, layers_per_block=2,
        block_out_channels=(320, 640, 1280, 1280),
        down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
        cross_attention_dim=768, attention_head_dim=8, norm_num_groups=32,
    )
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, layers_per_block=2, sample_size=512,
        block_out_channels=(128, 256, 512, 512),
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
    )
    with tempfile.TemporaryDirectory() as tmp:
        # The local BPE tokenizer (a real CLIP tokenizer class, smaller vocabulary: ids stay
        # inside SD 1.5's 49408-row embedding); the text model is SD 1.5's CLIP ViT-L/14 text half.
        write_tokenizer(Path(tmp))
        tokenizer = CLIPTokenizer.from_pretrained(tmp)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
        num_attention_heads=12, max_position_embeddings=77, hidden_act="quick_gelu",
        projection_dim=768,
    ))
    scheduler = PNDMScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", num_train_timesteps=1000,
        skip_prk_steps=True, steps_offset=1, set_alpha_to_one=False,
    )
    pipe = StableDiffusionPipeline(
        vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet, scheduler=scheduler,
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )
    pipe.save_pretrained(out, safe_serialization=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--mode", default="int8", choices=["int8", "int4", "hybrid", "full_int8"])
    parser.add_argument("--precision", default="auto", choices=["auto", "bf16", "f16", "f32"],
                        help="export.inference_precision (parity and openvino_static_f32: f32)")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "sd15-bench")
    parser.add_argument("--report", type=Path, default=Path("benchmarks/export/results.json"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    from tasks.export.config import ExportConfig
    from tasks.export.core import export

    src = args.work / "sd15-random"
    start = time.perf_counter()
    if not (src / "model_index.json").is_file():
        build_sd15(src)
    build_s = time.perf_counter() - start
    cfg = ExportConfig(
        height=args.size, width=args.size, inference_precision=args.precision,
        parity={"num_inference_steps": args.steps, "min_psnr_db": None},
        compression={"mode": args.mode, "calibration_prompts": ["a photo of a toy"],
                     "num_samples": 10},
    )
    out = args.work / f"openvino-{args.mode}-{args.precision}"
    report = export(src, out, cfg)
    lat = report["latency_s"]
    report["benchmark"] = {
        "build_s": round(build_s, 1),
        "steps": args.steps,
        "size": args.size,
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "ratios_vs_eager": {k: v for k, v in lat.items() if k.startswith("speedup_")},
        "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
    }
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({"latency_s": lat, "compression": report["compression"],
                      "inference_precision": report["inference_precision"],
                      "parity": report["parity"], "size_mb": report["size_mb"]}, indent=2))


if __name__ == "__main__":
    main()
