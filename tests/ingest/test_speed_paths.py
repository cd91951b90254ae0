"""The speed machinery must not change results: cache, worker processes, duplicate index."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
from PIL import Image

from tasks.ingest.cache import KEEP_FINGERPRINTS
from tasks.ingest.dedup import NearIndex
from tests.ingest.util import picture, run_folder, save

pytestmark = pytest.mark.quick  # make test-fast


def corpus(src: Path, n: int) -> None:
    for i in range(n):
        save(src / f"d{i % 3}" / f"img {i}.png", picture(i, (80 + i, 72)), caption=f"image {i}")
    save(src / "copy.png", picture(0, (80, 72)))  # exact duplicate of d0/img 0.png
    (src / "bad.png").write_text("not an image")
    save(src / "small.png", Image.new("RGB", (8, 8)))


def files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def test_cache_and_workers_give_byte_identical_outputs(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr("tasks.ingest.core.POOL_MIN_ITEMS", 0)  # use worker processes anyway
    src, cache = tmp_path / "src", tmp_path / "cache"
    corpus(src, 12)
    cold = run_folder(src, tmp_path / "cold")
    first = run_folder(src, tmp_path / "first", cache_dir=str(cache), workers=2)
    warm = run_folder(src, tmp_path / "warm", cache_dir=str(cache), workers=2)
    assert first.summary.cache_hits <= 1  # the duplicate may find its twin's fresh entry
    # every input that was read and decoded comes from the cache: 12 images, the copy, 2 bad
    assert warm.summary.cache_hits == 15
    assert files(cold.out) == files(first.out) == files(warm.out)
    assert cold.rejected == first.rejected == warm.rejected
    assert cold.summary.report() == warm.summary.report()


def test_adding_images_processes_only_the_new_ones(tmp_path: Path) -> None:
    src, cache = tmp_path / "src", tmp_path / "cache"
    corpus(src, 6)
    run_folder(src, tmp_path / "a", cache_dir=str(cache))
    save(src / "new" / "late.png", picture(99), caption="added later")
    r = run_folder(src, tmp_path / "b", cache_dir=str(cache))
    assert r.summary.total == 10 and r.summary.cache_hits == 9
    assert "new/late.png" in r.by_path()
    # a parameter that changes the pixels starts a new, cold set (the one hit: the duplicate
    # finds its twin's entry); old sets are pruned
    for res in (40, 48, 56):
        cold = run_folder(src, tmp_path / f"r{res}", cache_dir=str(cache), resolution=res)
        assert cold.summary.cache_hits == 1
    assert len([d for d in cache.iterdir() if d.is_dir()]) == KEEP_FINGERPRINTS
    # a caption-only change reuses every processed image
    again = run_folder(src, tmp_path / "c", cache_dir=str(cache), resolution=56,
                       captions={"fallback": "other"})
    assert again.summary.cache_hits == 10


def test_near_index_finds_what_a_full_scan_finds() -> None:
    rng = random.Random(0)
    base = [rng.getrandbits(64) for _ in range(300)]
    queries = [h ^ (1 << rng.randrange(64)) ^ (1 << rng.randrange(64)) for h in base[:100]]
    queries += [rng.getrandbits(64) for _ in range(100)]
    for distance in (0, 2, 5):
        index = NearIndex(distance)
        for i, h in enumerate(base):
            index.add(h, f"n{i}")
        for q in queries:
            scan = min(((bin(q ^ h).count("1"), i) for i, h in enumerate(base)), default=None)
            expected = (f"n{scan[1]}", scan[0]) if scan and scan[0] <= distance else None
            assert index.find(q) == expected
