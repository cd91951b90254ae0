"""Images per second of the ingest annotators at their real sizes, random weights, on this CPU.

    .venv/bin/python benchmarks/annotate/bench.py [--repeats 3] [--threads N] [--florence]

BLIP base (`Salesforce/blip-image-captioning-base`'s architecture: BlipConfig's defaults) and
CLIPSeg rd64-refined (ViT-B/16, reduce_dim 64, layers 3/6/9, the refined transposed
convolution) are built from their configs with random weights and run through the stage's own
`Captioner.compute` / `Masker.compute` on 512 px photo-like images, batch sizes 1 and 8. Random
weights stop at random points, so captions are forced to `--tokens` new tokens (min = max),
the length of a typical BLIP caption. `--florence` also times Florence-2-base's architecture
(DaViT + BART-base, 768 px) through `generate` directly (its processor needs its hub files).
Prints one JSON line per row and writes benchmarks/annotate/results.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tasks.common.allocator import in_use
from tasks.ingest.annotate_config import CaptionerConfig, MaskerConfig
from tasks.ingest.captioner import Captioner
from tasks.ingest.config import Captions
from tasks.ingest.masker import Masker
from tasks.ingest.tiny_annotators import _byte_clip_tokenizer

HERE = Path(__file__).resolve().parent


def photos(n: int, size: int = 512) -> list[Image.Image]:
    """Smooth colour fields with a disc and mild noise: photo-like, distinct."""
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:size, 0:size] / size
    out = []
    for _ in range(n):
        base = np.stack([rng.uniform(0, 255) * (a * xx + (1 - a) * yy) for a in rng.uniform(0, 1, 3)], -1)
        cx, cy, r = rng.uniform(0.3, 0.7, 2).tolist() + [rng.uniform(0.1, 0.3)]
        disc = (xx - cx) ** 2 + (yy - cy) ** 2 < r * r
        base[disc] = rng.uniform(0, 255, 3)
        base += rng.normal(0, 6, base.shape)
        out.append(Image.fromarray(base.clip(0, 255).astype(np.uint8), "RGB"))
    return out


def build_blip(out: Path) -> Path:
    from transformers import (
        BertTokenizer,
        BlipConfig,
        BlipForConditionalGeneration,
        BlipImageProcessorPil,
        BlipProcessor,
    )

    config = BlipConfig()  # the defaults are BLIP base: ViT-B/16 at 384 px, BERT-base decoder
    torch.manual_seed(0)
    BlipForConditionalGeneration(config).save_pretrained(out)
    vocab = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "[MASK]": 4, "[DEC]": 5}
    vocab.update({f"w{i}": i for i in range(6, config.text_config.vocab_size)})
    tokenizer = BertTokenizer(vocab=vocab, bos_token="[DEC]")
    processor = BlipImageProcessorPil(size={"height": 384, "width": 384})
    BlipProcessor(image_processor=processor, tokenizer=tokenizer).save_pretrained(out)
    return out


def build_clipseg(out: Path) -> Path:
    from transformers import (
        CLIPSegConfig,
        CLIPSegForImageSegmentation,
        CLIPSegProcessor,
        CLIPTokenizer,
        ViTImageProcessorPil,
    )

    _byte_clip_tokenizer(out)  # token ids only; the model's vocabulary is the real size
    config = CLIPSegConfig(vision_config={"patch_size": 16}, use_complex_transposed_convolution=True)
    torch.manual_seed(0)
    CLIPSegForImageSegmentation(config).save_pretrained(out)
    processor = ViTImageProcessorPil(size={"height": 352, "width": 352}, image_mean=[0.485, 0.456, 0.406],
                                     image_std=[0.229, 0.224, 0.225])
    CLIPSegProcessor(image_processor=processor, tokenizer=CLIPTokenizer.from_pretrained(out)).save_pretrained(out)
    return out


def timed(fn, images: list[Image.Image], batch: int, repeats: int) -> dict:
    fn(images[:batch])  # warm-up: first-call allocations, lazy inits
    rates, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        for i in range(0, len(images), batch):
            fn(images[i : i + batch])
        wall, used = time.perf_counter() - t0, time.process_time() - c0
        rates.append(len(images) / wall)
        cpu.append(used / len(images))
    return {"img_per_s": round(statistics.median(rates), 3), "min": round(min(rates), 3),
            "max": round(max(rates), 3), "cpu_s_per_img": round(statistics.median(cpu), 3),
            "images": len(images), "repeats": repeats}


def florence_fn(tokens: int):
    from transformers import Florence2Config, Florence2ForConditionalGeneration

    # Florence-2-base: DaViT (128/256/512/1024, depths 1/1/9/1), BART-base text (768, 6 + 6).
    config = Florence2Config(
        vision_config={"projection_dim": 768},
        text_config={"d_model": 768, "encoder_layers": 6, "decoder_layers": 6, "encoder_attention_heads": 12,
                     "decoder_attention_heads": 12, "encoder_ffn_dim": 3072, "decoder_ffn_dim": 3072,
                     "vocab_size": 51290},  # 51289 tokens + the image placeholder
    )
    torch.manual_seed(0)
    model = Florence2ForConditionalGeneration(config).eval()
    print(json.dumps({"florence2_params_M": round(sum(p.numel() for p in model.parameters()) / 1e6, 1)}))
    # The processor puts one placeholder per image feature (577) before the ~8-token question
    # that "<CAPTION>" becomes.
    image_tokens = torch.full((1, 577), config.image_token_id)
    prompt = torch.cat([image_tokens, torch.randint(10, 1000, (1, 8))], dim=1)

    def fn(images: list[Image.Image]) -> None:
        pixels = torch.randn(len(images), 3, 768, 768)
        with torch.inference_mode():
            model.generate(input_ids=prompt.expand(len(images), -1), pixel_values=pixels,
                           max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, num_beams=1)
    return fn


def captioner_fn(tmp: Path, tokens: int):
    config = CaptionerConfig(model="builtin:bench", revision=None, max_new_tokens=tokens)
    captioner = Captioner(config, Captions(), build_blip(tmp / "blip"), "bench")
    captioner.model.generation_config.min_new_tokens = tokens  # random weights stop anywhere
    return lambda images: captioner.compute(images, [{}] * len(images))  # rows without a concept


def masker_fn(tmp: Path):
    masker = Masker(MaskerConfig(model="builtin:bench", prompt="toy"), build_clipseg(tmp / "clipseg"), "bench")
    return lambda images: masker.compute(images, [{}] * len(images))  # rows without a concept: `prompt`


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--images", type=int, default=16, help="images per repeat")
    parser.add_argument("--tokens", type=int, default=20, help="new tokens per caption")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--florence", action="store_true")
    parser.add_argument("--only", choices=["blip-base", "clipseg-rd64-refined", "florence-2-base"], default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    images = photos(args.images)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        factories = {
            "blip-base": lambda: captioner_fn(Path(tmp), args.tokens),
            "clipseg-rd64-refined": lambda: masker_fn(Path(tmp)),
            "florence-2-base": lambda: florence_fn(args.tokens),
        }
        names = [args.only] if args.only else [*factories][: 3 if args.florence else 2]
        models = {name: factories[name]() for name in names}
        for name, fn in models.items():
            for batch in (1, 8):
                row = {"model": name, "batch": batch, **timed(fn, images, batch, args.repeats),
                       "load_avg_1min": round(os.getloadavg()[0], 2), "allocator": in_use()}
                print(json.dumps(row), flush=True)
                rows.append(row)
                save(rows, args)


def save(rows: list[dict], args: argparse.Namespace) -> None:
    """results.json: this run's rows replace earlier rows of the same model and batch size."""
    path = HERE / "results.json"
    old = json.loads(path.read_text())["rows"] if path.is_file() else []
    done = {(r["model"], r["batch"]) for r in rows}
    meta = {"threads": torch.get_num_threads(), "torch": torch.__version__, "cpus": os.cpu_count(),
            "tokens": args.tokens, "image_px": 512, "date": time.strftime("%Y-%m-%d")}
    keep = [r for r in old if (r["model"], r["batch"]) not in done]
    path.write_text(json.dumps({"meta": meta, "rows": keep + rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
