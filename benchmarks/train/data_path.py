"""The train stage's data path at 1k to 100k images of mixed sizes: images/s and peak RSS, no model.

`one --count N` measures one dataset size in this process: read the imagefolder, assign buckets,
then load one epoch in bucketed batches (the stage's TrainDataset, BucketBatchSampler and
collate; the model replaced by nothing). `--mode decode` decodes, resizes and crops every image
(and hashes it for its latent key), as a run without a warm disk cache does; `--mode cached`
first fills a disk latent cache (untimed: DiskLatentStore entries of SD's latent size, 4
channels at 1/8 of the bucket's sides, mean and log-variance) and then times the epoch with the
cache warm, as a later run or epoch reads it: per image a stat, its remembered hash and its
latent file, and no decode. `matrix` runs `one` per size and mode, each in its own process (so
each peak RSS is its own), and prints a JSON line each. Datasets are generated once under
.cache/bench/datapath-<N>[-x<scale>]/ (portrait, landscape, square; 64-160 px sides, times
`--scale`; buckets for resolution 64 x scale), their latent caches beside them.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parents[2]
SIZES = [(64, 96), (96, 64), (80, 80), (64, 160), (160, 64), (120, 90)]  # (width, height)


def dataset_dir(count: int, scale: int) -> Path:
    return REPO / ".cache" / "bench" / (f"datapath-{count}" + (f"-x{scale}" if scale != 1 else ""))


def make_dataset(count: int, scale: int = 1) -> Path:
    folder = dataset_dir(count, scale)
    if (folder / "metadata.jsonl").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    with open(folder / "metadata.jsonl.tmp", "w") as fh:
        for i in range(count):
            w, h = (side * scale for side in SIZES[i % len(SIZES)])
            small = rng.integers(0, 256, (4 * scale, 4 * scale, 3), dtype=np.uint8)
            Image.fromarray(small).resize((w, h), Image.Resampling.BICUBIC).save(folder / f"{i}.jpg", quality=90)
            fh.write(json.dumps({"file_name": f"{i}.jpg", "text": f"image {i}", "width": w, "height": h}) + "\n")
    (folder / "metadata.jsonl.tmp").rename(folder / "metadata.jsonl")
    return folder


def fill_cache(dataset, sampler, collate) -> int:
    """Write a latent entry for every example not yet stored (what the first run's VAE would write)."""
    import torch

    written = 0
    for batch_indices in sampler:
        batch = collate([dataset[i] for i in batch_indices])
        given = batch.cached_latents or [None] * len(batch.latent_keys)
        for i, key in enumerate(batch.latent_keys):
            if given[i] is None:
                h, w = batch.geometry.target_sizes[i].tolist()
                dataset.latent_store[key] = {"parameters": torch.zeros(1, 8, h // 8, w // 8),
                                             "original_size": batch.geometry.original_sizes[i],
                                             "crop_top_left": batch.geometry.crops_top_left[i]}
                written += 1
    return written


def one(count: int, batch: int, mode: str, scale: int) -> dict:
    import torch
    from torch.utils.data import DataLoader

    from tasks.train.buckets import BucketBatchSampler, kohya_buckets
    from tasks.train.data import TrainDataset, collate, read_imagefolder
    from tasks.train.latent_store import DiskLatentStore

    torch.set_num_threads(1)
    folder = make_dataset(count, scale)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    records = read_imagefolder(folder, "images", "")
    res = 64 * scale
    dataset = TrainDataset(records, None, lambda r, rng: r.text, "", res,
                           buckets=kohya_buckets(res, res // 2, res * 2, 8 * scale))
    sampler = BucketBatchSampler(dataset.example_buckets(), batch, 0)
    setup = time.perf_counter() - start
    filled = 0
    if mode == "cached":
        cache = folder.with_name(folder.name + "-latents")
        dataset.read_latents_from(DiskLatentStore(cache, None, folder="bench-vae"))  # type: ignore[arg-type]
        filled = fill_cache(dataset, sampler, collate)
    start, cpu, images, decoded = time.perf_counter(), time.process_time(), 0, 0
    for b in DataLoader(dataset, batch_sampler=sampler, collate_fn=collate):
        images += b["num_instances"]
        decoded += b["pixels"].shape[0]
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {"images": count, "scale": scale, "mode": mode, "loaded": images, "decoded": decoded,
            "cache_filled": filled, "buckets": len(dataset.bucket_counts()), "setup_s": round(setup, 2),
            "images_per_s": round(images / seconds, 1), "cpu_ms_per_image": round(1000 * cpu / images, 3),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "rss_before_data_mb": round(rss_before / 1024, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_one = sub.add_parser("one")
    p_one.add_argument("--count", type=int, required=True)
    p_one.add_argument("--batch", type=int, default=8)
    p_one.add_argument("--mode", choices=["decode", "cached"], default="decode")
    p_one.add_argument("--scale", type=int, default=1, help="image sides and resolution times this")
    p_matrix = sub.add_parser("matrix")
    p_matrix.add_argument("--counts", type=int, nargs="+", default=[1000, 10000])
    p_matrix.add_argument("--modes", nargs="+", choices=["decode", "cached"], default=["decode"])
    p_matrix.add_argument("--scale", type=int, default=1)
    args = parser.parse_args()
    if args.cmd == "one":
        print(json.dumps(one(args.count, args.batch, args.mode, args.scale)))
        return
    for count in args.counts:
        make_dataset(count, args.scale)
        for mode in args.modes:
            done = subprocess.run(
                [sys.executable, __file__, "one", "--count", str(count), "--mode", mode, "--scale", str(args.scale)],
                capture_output=True, text=True, check=True, cwd=REPO,
                env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
            print(done.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
