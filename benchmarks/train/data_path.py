"""The train stage's data path at 1k and 10k images of mixed sizes: images/s and peak RSS, no model.

`one --count N` measures one dataset size in this process: read the imagefolder, assign buckets,
load, resize and crop every image of one epoch in bucketed batches (the stage's TrainDataset,
BucketBatchSampler and collate; the model replaced by nothing). `matrix` runs `one` per size, each
in its own process (so each peak RSS is its own), and prints a JSON line per size. Datasets are
generated once under .cache/bench/datapath-<N>/ (portrait, landscape, square; 64-160 px sides).
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


def make_dataset(count: int) -> Path:
    folder = REPO / ".cache" / "bench" / f"datapath-{count}"
    if (folder / "metadata.jsonl").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    with open(folder / "metadata.jsonl.tmp", "w") as fh:
        for i in range(count):
            w, h = SIZES[i % len(SIZES)]
            Image.fromarray(rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)).resize((w, h)).save(folder / f"{i}.jpg")
            fh.write(json.dumps({"file_name": f"{i}.jpg", "text": f"image {i}", "width": w, "height": h}) + "\n")
    (folder / "metadata.jsonl.tmp").rename(folder / "metadata.jsonl")
    return folder


def one(count: int, batch: int) -> dict:
    import torch
    from torch.utils.data import DataLoader

    from tasks.train.buckets import BucketBatchSampler, kohya_buckets
    from tasks.train.data import TrainDataset, collate, read_imagefolder

    torch.set_num_threads(1)
    folder = make_dataset(count)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    records = read_imagefolder(folder, "images", "")
    dataset = TrainDataset(records, None, lambda r, rng: r.text, "", 64, buckets=kohya_buckets(64, 32, 128, 8))
    sampler = BucketBatchSampler(dataset.example_buckets(), batch, 0)
    setup = time.perf_counter() - start
    start, images = time.perf_counter(), 0
    for b in DataLoader(dataset, batch_sampler=sampler, collate_fn=collate):
        images += b["num_instances"]
    seconds = time.perf_counter() - start
    return {"images": count, "loaded": images, "buckets": len(dataset.bucket_counts()), "setup_s": round(setup, 2),
            "images_per_s": round(images / seconds, 1),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "rss_before_data_mb": round(rss_before / 1024, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_one = sub.add_parser("one")
    p_one.add_argument("--count", type=int, required=True)
    p_one.add_argument("--batch", type=int, default=8)
    p_matrix = sub.add_parser("matrix")
    p_matrix.add_argument("--counts", type=int, nargs="+", default=[1000, 10000])
    args = parser.parse_args()
    if args.cmd == "one":
        print(json.dumps(one(args.count, args.batch)))
        return
    for count in args.counts:
        make_dataset(count)
        done = subprocess.run([sys.executable, __file__, "one", "--count", str(count)], capture_output=True,
                              text=True, check=True, cwd=REPO, env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
        print(done.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
