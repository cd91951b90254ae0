"""Aspect-ratio buckets: every image trains whole, resized to the bucket nearest its aspect ratio.

The buckets are kohya sd-scripts' (`enable_bucket`, `min_bucket_reso`, `max_bucket_reso`,
`bucket_reso_steps`: sides that are multiples of the step, area at most resolution^2) or a fixed
list (diffusers' `aspect_ratio_buckets`, "h,w;h,w" or a list of [h, w]). Each image goes to the
bucket nearest its aspect ratio (diffusers' `find_nearest_bucket`).

A batch holds images of one bucket only (and, in an edit dataset, targets with one number of reference
images: a batch is one token sequence length, so the sampler's groups are (bucket, references)). Per
epoch a generator seeded by (seed, epoch) shuffles the images inside each group, cuts each group into
batches (the last batch of a group may be smaller, as in kohya) and shuffles the batches: the order is
a function of (seed, epoch) alone, so every rank derives it without communication and a resume that
skips the batches already trained continues exactly.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np
from torch.utils.data import Sampler

Bucket = tuple[int, int]  # (height, width), diffusers' order


def kohya_buckets(resolution: int, min_reso: int, max_reso: int, step: int) -> list[Bucket]:
    """Sides from min_reso to max_reso in multiples of `step`, area at most resolution^2 (kohya's rule)."""
    max_area = resolution * resolution
    found = {(resolution // step * step,) * 2}
    width = min_reso
    while width <= max_reso:
        height = min(max_reso, (max_area // width) // step * step)
        if height >= min_reso:
            found.add((height, width))
            found.add((width, height))
        width += step
    return sorted(found)


def parse_buckets(spec: str | list) -> list[Bucket]:
    """A fixed bucket list: diffusers' string form 'h,w;h,w' (parse_buckets_string) or [[h, w], ...]."""
    from diffusers.training_utils import parse_buckets_string

    if isinstance(spec, str):
        return [tuple(b) for b in parse_buckets_string(spec)]  # type: ignore[misc]
    return [(int(h), int(w)) for h, w in spec]


def assign(sizes: list[tuple[int, int]], buckets: list[Bucket]) -> list[int]:
    """The index of the bucket nearest each (height, width) in aspect ratio."""
    from diffusers.training_utils import find_nearest_bucket

    return [find_nearest_bucket(h, w, buckets) for h, w in sizes]


def counts(buckets: list[Bucket], bucket_of: list[int]) -> dict[str, int]:
    """Images per bucket, as 'HxW' -> count (empty buckets left out), for logs and the report."""
    n = Counter(bucket_of)
    return {f"{h}x{w}": n[i] for i, (h, w) in enumerate(buckets) if n[i]}


class BucketBatchSampler(Sampler):
    """Batches of (epoch, index) within one group; `bucket_of[index]` is the example's group (its bucket,
    or (bucket, reference count): any sortable key)."""

    def __init__(self, bucket_of: list[Any], batch_size: int, seed: int) -> None:
        self.bucket_of, self.batch_size, self.seed, self.epoch = list(bucket_of), batch_size, seed, 0
        self.members: dict[Any, list[int]] = {}
        for index, bucket in enumerate(self.bucket_of):
            self.members.setdefault(bucket, []).append(index)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def batches(self, epoch: int) -> list[list[int]]:
        rng = np.random.default_rng([self.seed, epoch, 7])
        out: list[list[int]] = []
        for bucket in sorted(self.members):
            indices = [self.members[bucket][i] for i in rng.permutation(len(self.members[bucket]))]
            out += [indices[i : i + self.batch_size] for i in range(0, len(indices), self.batch_size)]
        return [out[i] for i in rng.permutation(len(out))]

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        return iter([[(self.epoch, i) for i in batch] for batch in self.batches(self.epoch)])

    def __len__(self) -> int:
        return sum(-(-len(m) // self.batch_size) for m in self.members.values())
