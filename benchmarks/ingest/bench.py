"""Ingest speed and memory, measured on generated images (figures go in README.md here).

    .venv/bin/python benchmarks/ingest/bench.py all [--work /tmp/ingest-bench] [--n 200]

    throughput  512 and 1024 px JPEGs and PNGs -> 512 px: a plain one-process PIL loop next to
                the stage's code (tasks.ingest.core.ingest) with 1 and 2 worker processes
    memory      peak RSS of the stage at 1k and 100k small images (main process and workers)
    buckets     the same at 1k, 10k and 100k images of mixed sizes and aspect ratios, kept whole
                for aspect-ratio bucketing (output_size short_side: no crop, width/height recorded)
    cache       a cold run over 10k small images, then a re-run after adding 10 images
    masks       memory's small images, each with a `-masklabel.png` beside it, at --counts sizes

Generated inputs are kept under --work and reused by later runs (delete it to start over).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tasks.ingest.config import IngestConfig  # noqa: E402
from tasks.ingest.core import ingest  # noqa: E402


def photo(rng: np.random.Generator, w: int, h: int) -> Image.Image:
    """Photo-like content: smooth colour fields, edges and mild sensor noise (not flat, not noise)."""
    small = rng.integers(0, 256, (6, 6, 3), dtype=np.uint8)
    field = np.asarray(Image.fromarray(small).resize((w, h), Image.Resampling.BICUBIC), np.float32)
    y, x = np.mgrid[0:h, 0:w]
    for _ in range(4):  # a few hard-edged discs
        cx, cy, r = rng.integers(0, w), rng.integers(0, h), rng.integers(h // 10, h // 3)
        field[(x - cx) ** 2 + (y - cy) ** 2 < r * r] = rng.integers(0, 256, 3)
    field += rng.normal(0, 3, field.shape)
    return Image.fromarray(np.clip(field, 0, 255).astype(np.uint8))


SIZES = {"512": [(512, 512), (512, 640), (640, 512)], "1024": [(1024, 1024), (1024, 768), (768, 1024)]}


def make_photos(folder: Path, n: int, size_class: str, fmt: str) -> Path:
    """n images of a size class in JPEG (quality 90) or PNG (zlib level 1, quick to make; decoding
    costs about the same at any level), with captions; reused if present."""
    done = folder.with_name(f".{folder.name}.complete")  # beside the folder: not an input
    if done.exists() and int(done.read_text()) == n:
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(int(size_class) + (fmt == "png"))
    for i in range(n):
        w, h = SIZES[size_class][i % 3]
        path = folder / f"img_{i:05d}.{'jpg' if fmt == 'jpeg' else 'png'}"
        photo(rng, w, h).save(path, **({"quality": 90} if fmt == "jpeg" else {"compress_level": 1}))
        path.with_suffix(".txt").write_text(f"a photo number {i}")
    done.write_text(str(n))
    return folder


def make_small(folder: Path, n: int, start: int = 0) -> Path:
    """n distinct 64x64 PNGs (8x8 random blocks), 1,000 per sub-folder; reused if present."""
    done = folder.with_name(f".{folder.name}.complete-{start}-{n}")  # beside: not an input
    if done.exists():
        return folder
    rng = np.random.default_rng(start)
    for i in range(start, start + n):
        sub = folder / f"part_{i // 1000:03d}"
        sub.mkdir(parents=True, exist_ok=True)
        blocks = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
        Image.fromarray(blocks).resize((64, 64), Image.Resampling.NEAREST).save(sub / f"{i:06d}.png")
    folder.parent.mkdir(parents=True, exist_ok=True)
    done.write_text("ok")
    return folder


def make_masked(folder: Path, n: int) -> Path:
    """make_small's n images, each with a `<stem>-masklabel.png` beside it (a centred square); reused if present."""
    done = folder.with_name(f".{folder.name}.complete-masks-{n}")
    if done.exists():
        return folder
    make_small(folder, n)
    mask = Image.new("L", (64, 64), 0)
    mask.paste(255, (16, 8, 48, 56))
    for i in range(n):
        mask.save(folder / f"part_{i // 1000:03d}" / f"{i:06d}-masklabel.png")
    done.write_text("ok")
    return folder


MIXED = [(64, 96), (96, 64), (80, 80), (64, 160), (160, 64), (120, 90), (72, 128), (128, 72)]  # (w, h)


def make_mixed(folder: Path, n: int) -> Path:
    """n distinct JPEGs (random 8x8 blocks, quality 90) of the MIXED sizes: portrait, landscape,
    square, up to 2.5:1; 1,000 per sub-folder; reused if present."""
    done = folder.with_name(f".{folder.name}.complete-{n}")  # beside: not an input
    if done.exists():
        return folder
    rng = np.random.default_rng(n)
    for i in range(n):
        sub = folder / f"part_{i // 1000:03d}"
        sub.mkdir(parents=True, exist_ok=True)
        blocks = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
        size = MIXED[i % len(MIXED)]
        Image.fromarray(blocks).resize(size, Image.Resampling.NEAREST).save(sub / f"{i:06d}.jpg", quality=90)
    done.write_text("ok")
    return folder


def plain_loop(src: Path, out: Path, resolution: int, fmt: str) -> int:
    """What one writes without the stage: open, orient, RGB, resize, centre-crop, save; 1 process."""
    out.mkdir(parents=True, exist_ok=True)
    n = 0
    for path in sorted(src.iterdir()):
        if path.suffix not in (".jpg", ".png"):
            continue
        im = ImageOps.exif_transpose(Image.open(path)).convert("RGB")
        scale = resolution / min(im.size)
        im = im.resize((max(resolution, round(im.width * scale)),
                        max(resolution, round(im.height * scale))), Image.Resampling.LANCZOS)
        left, top = (im.width - resolution) // 2, (im.height - resolution) // 2
        im = im.crop((left, top, left + resolution, top + resolution))
        if fmt == "jpeg":
            im.save(out / f"{path.stem}.jpg", quality=95, subsampling=0)
        else:
            im.save(out / f"{path.stem}.png", compress_level=1)
        n += 1
    return n


def run_stage(src: Path, out: Path, **params) -> tuple[float, object]:
    cfg = IngestConfig.model_validate({"data_dir": None, "sources": [{"type": "folder", "path": str(src)}],
                                       "cache_dir": None, **params})
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    summary = ingest(cfg, out, out.parent / f"{out.name}.rejected.jsonl")
    return time.perf_counter() - start, summary


def measured(func, *args, **kw) -> tuple[object, float, float]:
    """(result, wall seconds, CPU seconds of all processes involved)."""
    with Monitor() as mon:
        start = time.perf_counter()
        result = func(*args, **kw)
        wall = time.perf_counter() - start
    return result, wall, mon.cpu_seconds


def pool_start_seconds() -> float:
    """Wall time for a fresh process to start the stage's worker pool and get a first result."""
    code = ("import time, multiprocessing as mp; t = time.perf_counter(); "
            "ctx = mp.get_context('forkserver'); "
            "ctx.set_forkserver_preload(['tasks.ingest.core', 'imagehash', 'scipy.fftpack']); "
            "p = ctx.Pool(2); p.map(abs, [1, 2]); print(time.perf_counter() - t); p.terminate()")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    return float(out.stdout.strip())


def throughput(work: Path, n: int) -> list[str]:
    # Warm up what a long run pays once: imports, and the fork server the workers come from.
    import imagehash  # noqa: F401
    import scipy.fftpack  # noqa: F401

    warm = make_small(work / "warmup", 64)
    run_stage(warm, work / "out_warmup", resolution=32, min_side=16, workers=2)
    print(f"starting the worker pool (once per stage run): {pool_start_seconds():.1f} s", flush=True)
    rows = ["| input | output | plain PIL loop, 1 process | stage, 1 worker | stage, 2 workers |",
            "|---|---|---|---|---|"]
    cases = [("512", "jpeg", "jpeg"), ("512", "jpeg", "png"), ("512", "png", "jpeg"),
             ("1024", "jpeg", "jpeg"), ("1024", "png", "jpeg")]
    for size_class, in_fmt, out_fmt in cases:
        src = make_photos(work / f"photos_{size_class}_{in_fmt}", n, size_class, in_fmt)
        count, wall, cpu = measured(plain_loop, src, work / "out_plain", 512, out_fmt)
        figures = [(count / wall, 1000 * cpu / count)]
        for workers in (1, 2):
            (_, summary), wall, cpu = measured(
                run_stage, src, work / f"out_stage{workers}", resolution=512,
                output_format=out_fmt, workers=workers)
            assert summary.kept == count, (summary.kept, count, summary.report())
            figures.append((summary.total / wall, 1000 * cpu / summary.total))
        label = f"{n} {in_fmt.upper()}s, {size_class} px class"
        rows.append(f"| {label} | 512 px {out_fmt.upper()} | "
                    + " | ".join(f"{r:.0f} img/s ({c:.1f} CPU-ms/img)" for r, c in figures) + " |")
        print(rows[-1], flush=True)
    return rows


class Monitor:
    """Samples this process and its descendants every 50 ms (psutil): peak RSS and CPU time.

    CPU seconds (user + system, all processes) say what the work costs whatever else runs on
    the machine; wall-clock figures on a shared machine depend on its load as well.
    """

    def __init__(self) -> None:
        import psutil

        self.proc = psutil.Process()
        self.main = self.worker = self.total = 0
        self._cpu: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        procs = [self.proc]
        try:
            procs += self.proc.children(recursive=True)
        except Exception:
            pass
        rss = []
        for p in procs:
            try:
                with p.oneshot():
                    t = p.cpu_times()
                    rss.append(p.memory_info().rss)
                    self._cpu[p.pid] = t.user + t.system
            except Exception:  # exited between listing and reading
                continue
        if rss:
            self.main, self.total = max(self.main, rss[0]), max(self.total, sum(rss))
            self.worker = max([self.worker, *rss[1:]])

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(0.05)

    @property
    def cpu_seconds(self) -> float:
        """CPU time used since __enter__ by this process and every descendant seen."""
        return sum(t - self._start.get(pid, 0.0) for pid, t in self._cpu.items())

    def __enter__(self) -> Monitor:
        self._sample()
        self._start = dict(self._cpu)  # processes alive before: count only what they add
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


SMALL = {"resolution": 32, "min_side": 16}  # the memory and cache runs: 64 px squares to 32 px squares
BUCKETED = {"resolution": 64, "min_side": 32, "output_size": "short_side"}  # kept whole, short side 64


def child_ingest(src: str, out: str, cache: str | None, workers: int, params: dict) -> None:
    """Run in a fresh process so peak RSS belongs to this run only; prints one JSON line."""
    with Monitor() as peak:
        seconds, summary = run_stage(Path(src), Path(out), **params, workers=workers, cache_dir=cache)
    print(json.dumps({
        "seconds": seconds, "total": summary.total, "kept": summary.kept,
        "cache_hits": summary.cache_hits, "cpu_seconds": peak.cpu_seconds, "masks": sum(summary.masks.values()),
        "main_peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "worker_peak_mib": peak.worker / 2**20, "all_peak_mib": peak.total / 2**20,
    }))


def in_child(src: Path, out: Path, cache: Path | None = None, workers: int = 2, params: dict = SMALL) -> dict:
    cmd = [sys.executable, __file__, "_child", str(src), str(out), str(cache or ""), str(workers), json.dumps(params)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True,
                          env={**os.environ, "TQDM_DISABLE": "1"})
    return json.loads(proc.stdout.strip().splitlines()[-1])


def memory(work: Path) -> list[str]:
    rows = ["| images (64 px PNG -> 32 px) | time | img/s | peak RSS main | peak RSS per worker"
            " | peak RSS all processes |",
            "|---|---|---|---|---|---|"]
    for n in (1_000, 100_000):
        src = make_small(work / f"small_{n}", n)
        r = in_child(src, work / f"out_small_{n}")
        rows.append(f"| {n:,} | {r['seconds']:.1f} s | {r['total'] / r['seconds']:.0f} | "
                    f"{r['main_peak_mib']:.0f} MiB | {r['worker_peak_mib']:.0f} MiB | "
                    f"{r['all_peak_mib']:.0f} MiB |")
        print(rows[-1], flush=True)
    return rows


def masks(work: Path, counts: list[int]) -> list[str]:
    rows = ["| images + masks (64 px PNG -> 32 px) | time | img/s | masks kept | peak RSS main | peak RSS per worker"
            " | peak RSS all processes |", "|---|---|---|---|---|---|---|"]
    for n in counts:
        src = make_masked(work / f"masked_{n}", n)
        r = in_child(src, work / f"out_masked_{n}")
        assert r["kept"] == r["masks"] == n, r
        rows.append(f"| {n:,} | {r['seconds']:.1f} s | {r['total'] / r['seconds']:.0f} | {r['masks']:,} | "
                    f"{r['main_peak_mib']:.0f} MiB | {r['worker_peak_mib']:.0f} MiB | {r['all_peak_mib']:.0f} MiB |")
        print(rows[-1], flush=True)
    return rows


def recorded_sizes(out: Path) -> tuple[int, int]:
    """(rows with width and height in metadata.jsonl, distinct aspect ratios among them)."""
    rows = [json.loads(line) for line in (out / "metadata.jsonl").read_text().splitlines() if line.strip()]
    sized = [r for r in rows if isinstance(r.get("width"), int) and isinstance(r.get("height"), int)]
    return len(sized), len({round(r["width"] / r["height"], 2) for r in sized})


def buckets(work: Path, counts: list[int]) -> list[str]:
    rows = ["| images (mixed JPEGs, kept whole) | time | img/s | CPU-ms/img | peak RSS main | peak RSS per worker "
            "| peak RSS all processes | sizes recorded | aspect ratios |", "|---|---|---|---|---|---|---|---|---|"]
    for n in counts:
        src, out = make_mixed(work / f"mixed_{n}", n), work / f"out_mixed_{n}"
        r = in_child(src, out, params=BUCKETED)
        sized, ratios = recorded_sizes(out)
        assert r["kept"] == n and sized == n, (r, sized)
        rows.append(f"| {n:,} | {r['seconds']:.1f} s | {r['total'] / r['seconds']:.0f} | "
                    f"{1000 * r['cpu_seconds'] / r['total']:.2f} | {r['main_peak_mib']:.0f} MiB | "
                    f"{r['worker_peak_mib']:.0f} MiB | {r['all_peak_mib']:.0f} MiB | {sized:,} | {ratios} |")
        print(rows[-1], flush=True)
    return rows


def cache(work: Path) -> list[str]:
    import shutil

    src, store = work / "cache_10k", work / "cache_store"
    shutil.rmtree(src / "part_new", ignore_errors=True)
    shutil.rmtree(store, ignore_errors=True)
    make_small(src, 10_000)
    cold = in_child(src, work / "out_cache_cold", store)
    new = src / "part_new"
    new.mkdir()
    rng = np.random.default_rng(12345)
    for i in range(10):
        blocks = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
        Image.fromarray(blocks).resize((64, 64), Image.Resampling.NEAREST).save(new / f"new_{i}.png")
    warm = in_child(src, work / "out_cache_warm", store)
    rows = ["| run | inputs | processed | from cache | time |", "|---|---|---|---|---|"]
    for name, r in (("cold (empty cache)", cold), ("after adding 10 images", warm)):
        rows.append(f"| {name} | {r['total']:,} | {r['total'] - r['cache_hits']:,} | "
                    f"{r['cache_hits']:,} | {r['seconds']:.1f} s |")
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_child":
        _, _, src, out, store, workers, params = sys.argv
        child_ingest(src, out, store or None, int(workers), json.loads(params))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["throughput", "memory", "buckets", "cache", "masks", "all"])
    parser.add_argument("--work", type=Path, default=Path("/tmp/ingest-bench"))
    parser.add_argument("--n", type=int, default=600, help="images per throughput case")
    parser.add_argument("--counts", type=int, nargs="+", default=[1_000, 10_000, 100_000],
                        help="dataset sizes of the buckets and masks runs")
    args = parser.parse_args()
    os.environ.setdefault("TQDM_DISABLE", "1")
    import logging

    logging.basicConfig(level=logging.WARNING)
    load = Path("/proc/loadavg").read_text().split()[:3]
    print(f"cpus: {len(os.sched_getaffinity(0))}, Pillow {Image.__version__}, "
          f"load average before: {' '.join(load)}", flush=True)
    tables = []
    if args.what in ("throughput", "all"):
        tables.append(throughput(args.work, args.n))
    if args.what in ("memory", "all"):
        tables.append(memory(args.work))
    if args.what in ("buckets", "all"):
        tables.append(buckets(args.work, args.counts))
    if args.what in ("cache", "all"):
        tables.append(cache(args.work))
    if args.what in ("masks", "all"):
        tables.append(masks(args.work, args.counts))
    print("\n\n".join("\n".join(t) for t in tables))
    print(f"load average after: {' '.join(Path('/proc/loadavg').read_text().split()[:3])}")


if __name__ == "__main__":
    main()
