"""Our train stage against diffusers' own example scripts, method by method, on the SD 1.5 architecture.

    .venv/bin/python benchmarks/diffusers_scripts.py          # once: the reference scripts (installed tag)
    make bench-env                                             # once: .venv-bench (torchvision for theirs)
    .venv-bench/bin/python -m benchmarks.train.vs_diffusers --resolutions 256 512 --runs 3
    .venv-bench/bin/python -m benchmarks.train.vs_diffusers --images demo --steps 30 --loops theirs ours-glibc
    .venv-bench/bin/python -m benchmarks.train.vs_diffusers --table

For each method, resolution and run: our stage (`python -m tasks.train`), then diffusers' script
for that method, unchanged, each in its own process, on the same model folder (the SD 1.5
architecture with seeded random weights, `benchmarks/export/sd15_random.py`), the same images,
resolution, batch, precision, learning rate and number of steps. Both are timed by one
optimizer-step hook (`benchmarks/steptimer.py`): s/step is the median interval between optimizer
steps after the warm-up steps; peak RSS is the process's, at the last step and at exit (loading,
saving and writing the output included). Their scripts get their fastest flags for this setting:
bf16 mixed precision (they cast the frozen parts to bf16 themselves), precomputed text embeddings
where the script offers it, `--set_grads_to_none`, and the foreach EMA update. Our stage preloads
tcmalloc when it is installed (launch.preload_allocator); `--loops ... theirs-tcmalloc` runs their
script with it too, to show what the allocator alone gives; `ours-glibc` runs ours on glibc's malloc
tuned by GLIBC_TUNABLES, what `auto` gives on a machine without tcmalloc. Page faults per step (minor faults:
memory the kernel had to map and zero) do not depend on the machine's load.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

from benchmarks.steptimer import add_run_arguments, compute_precision, mixed_precision, timed

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
INSTANCE, CLASS = "a photo of sks toy", "a photo of a toy"
TOKEN, INITIALIZER = "<sks>", "toy"


class Method:
    """One method's settings, shared by both sides, and the reference script that trains it."""

    def __init__(self, name: str, script: str, lr: float, prior: bool, ours: dict, theirs: list[str]) -> None:
        self.name, self.script, self.lr, self.prior = name, script, lr, prior
        self.ours, self.theirs = ours, theirs


PRIOR = ["--with_prior_preservation", "--num_class_images", "2", "--class_prompt", CLASS,
         "--pre_compute_text_embeddings"]
METHODS = {m.name: m for m in [
    Method("dreambooth", "train_dreambooth.py", 5e-6, True, {}, [*PRIOR, "--set_grads_to_none"]),
    Method("lora", "train_dreambooth_lora.py", 1e-4, True, {"rank": 4}, [*PRIOR, "--rank", "4"]),
    Method("textual_inversion", "textual_inversion.py", 5e-3, False,
           {"placeholder_token": TOKEN, "initializer_token": INITIALIZER, "num_vectors": 1},
           ["--placeholder_token", TOKEN, "--initializer_token", INITIALIZER, "--learnable_property", "object",
            "--num_vectors", "1", "--save_steps", str(10 ** 6)]),
    Method("full", "train_text_to_image.py", 1e-5, False,
           {"use_ema": True, "snr_gamma": 5.0, "caption_column": "text"},
           ["--use_ema", "--foreach_ema", "--snr_gamma", "5.0", "--caption_column", "text"]),
]}


def make_images(work: Path, images: str = "synthetic") -> dict[str, Path]:
    """Instance and class images at 512 px (`synthetic`: 2 generated instance images), or the demo
    subject's six pictures as instance images (`demo`: data/demo/subject, drawn if missing):
    imagefolders (images + metadata.jsonl with `text`) for our stage and train_text_to_image.py, and
    the images alone for the DreamBooth and TI scripts. Class images are 2 generated ones either way."""
    sys.path.insert(0, str(ROOT))
    from tests.train.conftest import write_imagefolder

    folders = {"class": write_imagefolder(work / "class", 2, CLASS, 1, size=(512, 512))}
    if images == "demo":
        folders["instance"] = demo_imagefolder(work / "instance")
    else:
        folders["instance"] = write_imagefolder(work / "instance", 2, INSTANCE, 0, size=(512, 512))
    for name in ("instance", "class"):
        bare = work / f"{name}-images"
        bare.mkdir(exist_ok=True)
        for image in folders[name].glob("*.png"):
            shutil.copy(image, bare / image.name)
        folders[f"{name}-images"] = bare
    return folders


def demo_imagefolder(folder: Path) -> Path:
    """The demo subject's pictures with the instance prompt as their `text` (both sides train on the prompt)."""
    subject = ROOT / "data/demo/subject"
    if not sorted(subject.glob("*.png")):
        subprocess.run([sys.executable, str(ROOT / "data/demo/generate.py"), "--out", str(subject)], check=True)
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for image in sorted(subject.glob("*.png")):
        shutil.copy(image, folder / image.name)
        rows.append(json.dumps({"file_name": image.name, "text": INSTANCE}))
    (folder / "metadata.jsonl").write_text("\n".join(rows) + "\n")
    return folder


def machine() -> dict[str, object]:
    """The CPU (model, bf16 and AMX flags) and the threads the runs had."""
    model, flags = platform.processor() or platform.machine(), set()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    wanted = ("avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    return {"cpu": model, "cpu_flags": [f for f in wanted if f in flags], "threads": len(os.sched_getaffinity(0))}


#: our stage with one setting changed, to measure what it gives (issue 15's list): `ours-native` and
#: `ours-ipex` are for the IPEX side environment (`.venv-ipex/bin/python -m benchmarks.train.vs_diffusers`),
#: where `ours` would pick IPEX by itself; `ours-compile`'s first step includes the compilation.
OURS_VARIANTS = {"ours": {}, "ours-native": {"cpu_backend": "native"}, "ours-ipex": {"cpu_backend": "ipex"},
                 "ours-compile": {"torch_compile": True},
                 # what `auto` gives where tcmalloc is not installed (a fresh machine), and glibc as it comes
                 "ours-glibc": {"launch": {"preload_allocator": "glibc"}},
                 "ours-glibc-defaults": {"launch": {"preload_allocator": "none"}},
                 "ours-fp32-weights": {"full_bf16": False}}
LOOPS = ["theirs", "theirs-tcmalloc", *OURS_VARIANTS]


def ours_command(method: Method, base: Path, work: Path, data: dict[str, Path], resolution: int, steps: int,
                 variant: str = "ours", compute: str = "bf16"):
    train = dict(
        method=method.name, instance_prompt=INSTANCE, class_prompt=CLASS, with_prior_preservation=method.prior,
        resolution=resolution, train_batch_size=1, max_train_steps=steps, learning_rate=method.lr,
        lr_scheduler="constant", mixed_precision=mixed_precision(compute), checkpointing_steps=10 ** 6,
        validation_prompts=[],
        num_validation_images=0, checkpoints_dir=str(work / "checkpoints"), resume="none", seed=0,
        system_metrics_interval=0, **method.ours, **OURS_VARIANTS[variant],
    )
    params = work / "params.yaml"
    params.write_text(yaml.safe_dump({"train": train}))
    return ["-m", "tasks.train", "--base", str(base), "--data", str(data["instance"]),
            "--class-data", str(data["class"]), "--out", str(work / "ours-out"),
            "--report", str(work / "ours-report.json"), "--plot", str(work / "ours-loss.csv"), "--params", str(params)]


def theirs_command(method: Method, base: Path, work: Path, data: dict[str, Path], resolution: int, steps: int,
                   compute: str = "bf16"):
    from benchmarks.diffusers_scripts import script

    if method.name == "full":
        inputs = ["--train_data_dir", str(data["instance"])]
    elif method.name == "textual_inversion":
        inputs = ["--train_data_dir", str(data["instance-images"])]
    else:
        inputs = ["--instance_data_dir", str(data["instance-images"]), "--instance_prompt", INSTANCE,
                  "--class_data_dir", str(data["class-images"])]
    return [str(script(method.script)), "--pretrained_model_name_or_path", str(base), *inputs,
            "--output_dir", str(work / "theirs-out"), "--resolution", str(resolution), "--center_crop",
            "--train_batch_size", "1", "--max_train_steps", str(steps), "--learning_rate", str(method.lr),
            "--lr_scheduler", "constant", "--mixed_precision", mixed_precision(compute),
            "--checkpointing_steps", str(10 ** 6),
            "--seed", "0", "--report_to", "mlflow", *method.theirs]


def run_pair(method: Method, base: Path, work: Path, data: dict[str, Path], args: argparse.Namespace,
             resolution: int, run: int) -> list[dict]:
    env = {"MLFLOW_TRACKING_URI": f"sqlite:///{work / 'mlflow.db'}", "PYTHONPATH": str(ROOT),
           "HF_DATASETS_CACHE": str(work / "hf-datasets"), "HF_HUB_OFFLINE": "1"}
    extra = {"theirs-tcmalloc": {"LD_PRELOAD": tcmalloc(), "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(2 ** 40)}}
    rows = []
    for loop in args.loops:
        for leftover in ("ours-out", "theirs-out", "checkpoints", "hf-datasets"):
            shutil.rmtree(work / leftover, ignore_errors=True)
        if loop in OURS_VARIANTS:  # writes this variant's params.yaml
            command = ours_command(method, base, work, data, resolution, args.steps, loop, args.compute)
        else:
            command = theirs_command(method, base, work, data, resolution, args.steps, args.compute)
        row = {"run": run, "model": "sd15-arch", "method": method.name, "resolution": resolution, "batch": 1,
               "images_per_step": 2 if method.prior else 1, "precision": args.compute,
               "date": time.strftime("%Y-%m-%d"),
               "images": args.images, "instance_images": len(list(data["instance-images"].glob("*.png"))),
               "steps": args.steps, "warmup": args.warmup, **machine(), **versions(),
               **timed(loop, command, work, args.warmup, {**env, **extra.get(loop, {})})}
        row["allocator"] = allocator_of(loop, work)
        if loop in OURS_VARIANTS:  # the loss curve (step, loss), to compare variants' training
            row["losses"] = [[int(float(a)), round(float(b), 5)] for a, b, *_ in
                             (line.split(",") for line in (work / "ours-loss.csv").read_text().split()[1:])]
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def allocator_of(loop: str, work: Path) -> str:
    """What the run's allocator was: our stage says it in its report; their script runs on glibc's
    malloc as it comes, unless `theirs-tcmalloc` preloaded tcmalloc."""
    if loop in OURS_VARIANTS:
        return json.loads((work / "ours-report.json").read_text()).get("allocator", "unknown")
    return "tcmalloc" if loop == "theirs-tcmalloc" else "glibc-defaults"


def versions() -> dict[str, str]:
    """The releases both sides ran on: their scripts are diffusers' examples at its installed tag."""
    from importlib.metadata import version

    return {name: version(name) for name in ("diffusers", "torch", "transformers", "accelerate", "peft")}


def tcmalloc() -> str:
    """The tcmalloc our stage preloads (launch.preload_allocator), for their script too."""
    from tasks.common.allocator import allocator_env, find_allocators

    return allocator_env("tcmalloc", find_allocators())["LD_PRELOAD"]


def table(results: list[dict]) -> str:
    """Markdown: what the rows ran on (CPU, its bf16/AMX flags, threads, torch, steps), then per
    images, method, resolution and loop the median s/step over runs (min-max), the speed-up against
    their script (their median over this loop's), the allocator, page faults per step, peak RSS."""
    rows = [_ran_on(results), "",
            "| method | px | images | loop | allocator | runs | s/step: median of runs (fastest-slowest step) "
            "| theirs / this | page faults per step | peak RSS GB, training / at exit |", "|---" * 10 + "|"]
    cells: dict[tuple, dict[str, list[dict]]] = {}
    for r in results:
        cells.setdefault((r["method"], r["resolution"], r.get("images", "synthetic")), {}).setdefault(
            r["loop"], []).append(r)
    for (method, px, images), loops in cells.items():
        theirs = statistics.median(r["s_per_step"] for r in loops["theirs"]) if "theirs" in loops else None
        for loop in [name for name in LOOPS if name in loops]:
            s = [r["s_per_step"] for r in loops[loop]]
            every = [x for r in loops[loop] for x in r.get("step_seconds", [r["s_per_step"]])]
            faults = [r["page_faults_per_step"] for r in loops[loop] if r.get("page_faults_per_step") is not None]
            ratio = f"{theirs / statistics.median(s):.2f}x" if theirs else ""
            fault_cell = int(statistics.median(faults)) if faults else ""
            allocators = "/".join(sorted({r.get("allocator", "?") for r in loops[loop]}))
            rows.append(f"| {method} | {px} | {images} | {loop} | {allocators} | {len(s)} | "
                        f"{statistics.median(s):.2f} ({min(every):.2f}-{max(every):.2f}) | {ratio} | {fault_cell} | "
                        f"{max(r['peak_rss_train_gb'] for r in loops[loop]):.1f} / "
                        f"{max(r['peak_rss_gb'] for r in loops[loop]):.1f} |")
    return "\n".join(rows)


def _ran_on(results: list[dict]) -> str:
    def values(key: str) -> str:
        found = {" ".join(v) if isinstance(v := r.get(key, "?"), list) else str(v) for r in results}
        return ", ".join(sorted(found))

    return (f"Ran on: {values('cpu')} (flags {values('cpu_flags')}), {values('threads')} threads, torch "
            f"{values('torch')}, diffusers {values('diffusers')}; {values('steps')} steps of which "
            f"{values('warmup')} warm-up; load average {min(r.get('load_average', 0) for r in results):.1f}-"
            f"{max(r.get('load_average', 0) for r in results):.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path, default=ROOT / ".cache/bench/sd15-arch")
    parser.add_argument("--work", type=Path, default=ROOT / ".cache/bench/train-vs-diffusers")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--resolutions", nargs="+", type=int, default=[256])
    parser.add_argument("--images", choices=["synthetic", "demo"], default="synthetic",
                        help="instance images: 2 generated ones, or the demo subject's six (data/demo/subject)")
    parser.add_argument("--loops", nargs="+", default=["ours", "theirs"], choices=LOOPS,
                        help="theirs-tcmalloc: their script with the allocator our stage preloads; ours-*: "
                             "our stage with one setting changed (OURS_VARIANTS)")
    add_run_arguments(parser, HERE / "results_vs_diffusers.json")
    parser.add_argument("--first-run", type=int, default=0,
                        help="label of the first run: more runs of cells already in --results (they are appended)")
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(args.results.read_text())))
        return
    args.base, args.work = args.base.resolve(), args.work.resolve()  # the runs' cwd is the work folder
    args.compute = compute_precision(args.compute)
    if not (args.base / "model_index.json").is_file():
        raise SystemExit(f"{args.base} is missing: run `.venv/bin/python -c \"from benchmarks.export.sd15_random "
                         f"import build_sd15; build_sd15('{args.base}')\"`")
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    data = make_images(args.work, args.images)
    results = json.loads(args.results.read_text()) if args.results.is_file() else []
    for run in range(args.first_run, args.first_run + args.runs):
        for resolution in args.resolutions:
            for name in args.methods:
                results += run_pair(METHODS[name], args.base, args.work, data, args, resolution, run)
                args.results.write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))


if __name__ == "__main__":
    main()
