"""FLUX.2 [klein] 4B through the whole chain on this machine: `dvc repro`, stage by stage, then registration.

    .venv/bin/python -m benchmarks.flux2_klein.build                 # once: .cache/bench/flux2-klein-4b
    .venv/bin/python -m benchmarks.flux2_klein.chain                 # results_chain.json
    .venv/bin/python -m benchmarks.flux2_klein.chain --stages base ingest class_images \
        --set class_images.base_model_precision=none --results results_class_images_bf16.json

A clone of this repository's HEAD in `--work` gets the demo subject (data/demo/generate.py) and
params.yaml set for the real model at a small size: `base.model` the built folder; 2 class images
at 256 px, 4 steps; LoRA rank 16 with prior preservation on an `int8` base with `int8` Qwen3,
gradient checkpointing, bf16, 128 Qwen3 tokens, 256 px, 3 steps, `fuse_lora: false`; the export at
256 px one model at a time (`export.components: one_at_a_time`) with 8-bit weight compression and the
per-model parity gate (the whole-pipeline image check, which runs PyTorch in fp32, off); evaluate on
one prompt, one image, 4 steps, on the int8 base train used. Then the registration (the 15 GB base by
reference: register.base_copy_max_gb), the registered version's pyfunc loaded through its models:/
URI predicting one image (`predict`), and `mlflow models serve` answering one request (`serve`,
serve_once.py, one worker). DVC's cache links
its files (`cache.type: hardlink`), as a team with 16 GB models sets it. Each stage runs as
`dvc repro -s <stage>` in a process of its own, so its peak RSS is its own (the largest process of
the stage, DVC's hashing included in the wall time). The chain stops at the first stage that fails,
and records how. A stage that needs more memory than the machine has is stopped when less than
`--floor-gb` stays available (past that it pages its weights in and out for as long as it runs, and
the machine with it): return code -9, with its process tree's resident size sampled until then.
`--stages` runs only the stages named (in the chain's order; a stage needs the ones before it), and
`--set section.key=value` (value read as YAML) changes a params.yaml key after the chain's own; both
are recorded in the results. `--resume` goes on in an earlier run's clone: HEAD's code is pulled into it,
its outputs stay, and the new rows join the earlier ones of `--results` (each row names its commit).
FLUX.1-dev runs the same chain with `--base .cache/bench/flux1-dev` (benchmarks/flux_dev/README.md).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
STAGES = ["base", "ingest", "class_images", "train", "export", "evaluate"]
#: after the DVC stages: the registration, the registered version's pyfunc predicting in this process,
#: and `mlflow models serve` answering one request
AFTER = ["register", "predict", "serve"]
#: FLUX.2 [klein] trained with lora registers as flux2-lora (the name follows what trained: tasks/register/naming.py)
MODEL_URI = "models:/flux2-lora/1"
#: one image from the registered version's pyfunc, loaded through its models:/ URI (manifest-checked)
_PREDICT = f"""import base64, io, json, time, mlflow
from PIL import Image
start = time.monotonic()
model = mlflow.pyfunc.load_model("{MODEL_URI}")
loaded = time.monotonic() - start
out = model.predict(["a photo of sks dog"], params={{"num_inference_steps": 4, "seed": 0, **__SIZE__}})
image = Image.open(io.BytesIO(base64.b64decode(out["image"][0])))
image.save("predicted.png")
print(json.dumps({{"load_s": round(loaded, 1), "predict_s": round(time.monotonic() - start - loaded, 1),
                  "image": list(image.size)}}))
"""

#: params.yaml keys set in the clone, per section (nested dicts update the section's dicts)
PARAMS = {
    "ingest": {"resolution": 256},
    "class_images": {"num_images": 2, "batch_size": 1, "resolution": 256, "num_inference_steps": 4},
    "train": {"method": "lora", "with_prior_preservation": True, "resolution": 256, "train_batch_size": 1,
              "max_train_steps": 3, "rank": 16, "base_model_precision": "int8", "text_encoder_precision": "int8",
              "gradient_checkpointing": True, "mixed_precision": "auto", "max_sequence_length": 128,
              "fuse_lora": False, "num_validation_images": 0, "validation_steps": 0, "checkpointing_steps": 1000},
    "export": {"components": "one_at_a_time", "height": 256, "width": 256, "compression": {"mode": "int8"},
               "parity": {"num_inference_steps": 2, "pipeline_image": False}, "latency_dynamic": False},
    "evaluate": {"max_prompts": 1, "images_per_prompt": 1, "num_inference_steps": 4, "resolution": 256,
                 "drift": {"enabled": False}},
}

#: Runs argv and prints, last, its return code, seconds and the peak RSS of its largest process.
_MEASURED = """import json, resource, subprocess, sys, time
start = time.monotonic()
rc = subprocess.run(sys.argv[1:]).returncode
print(json.dumps({"rc": rc, "seconds": round(time.monotonic() - start, 1),
                  "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2 ** 20, 2)}))
"""


def prepare(base: Path, work: Path, overrides: dict[str, dict[str, object]] | None = None) -> None:
    """A clone of HEAD with the demo subject and the chain's params, then `overrides` (section: keys)."""
    shutil.rmtree(work, ignore_errors=True)
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(work)], check=True)
    subprocess.run([sys.executable, "data/demo/generate.py", "--out", "data/demo/subject"], cwd=work, check=True)
    subprocess.run(["dvc", "config", "cache.type", "hardlink"], cwd=work, check=True)
    write_params(base, work, overrides)


def resume(base: Path, work: Path, overrides: dict[str, dict[str, object]] | None = None) -> None:
    """`work`'s clone brought to HEAD's code (its outputs and dvc.lock kept), the params written again."""
    subprocess.run(["git", "checkout", "--quiet", "--", "params.yaml"], cwd=work, check=True)
    subprocess.run(["git", "pull", "--quiet", "--ff-only"], cwd=work, check=True)
    write_params(base, work, overrides)


def write_params(base: Path, work: Path, overrides: dict[str, dict[str, object]] | None) -> None:
    """params.yaml of `work`: the chain's PARAMS, then `overrides`."""
    params = yaml.safe_load((work / "params.yaml").read_text())
    params["base"]["model"] = str(base)
    for section, keys in [*PARAMS.items(), *(overrides or {}).items()]:
        for key, value in keys.items():
            if isinstance(value, dict):
                params[section][key].update(value)
            else:
                params[section][key] = value
    (work / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def parse_sets(sets: list[str]) -> dict[str, dict[str, object]]:
    """`["section.key=value", ...]` as {section: {key: value}}, each value read as YAML."""
    overrides: dict[str, dict[str, object]] = {}
    for item in sets:
        name, eq, value = item.partition("=")
        section, dot, key = name.partition(".")
        if not (eq and dot and section and key):
            raise SystemExit(f"--set {item!r}: expected section.key=value")
        overrides.setdefault(section, {})[key] = yaml.safe_load(value)
    return overrides


def _tree_rss(pid: int) -> int:
    """Bytes resident in process `pid` and all its descendants now."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for proc in procs:
        try:
            total += proc.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def measured(argv: list[str], work: Path, log: Path, floor_gb: float) -> dict:
    """`argv` in `work` under the measuring wrapper, its output to `log`. Stopped (SIGKILL to its
    process group) when the machine's available memory falls under `floor_gb`: past that point a
    stage does not fail, it pages its weights in and out for as long as it runs."""
    import psutil

    tmp = work / f"tmp-{log.stem}"  # the step's temporary files (MLflow's downloads of the model), removed after it
    tmp.mkdir(exist_ok=True)
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{work / 'mlflow.db'}", "TMPDIR": str(tmp)}
    start, tree_peak, stopped = time.monotonic(), 0, None
    with open(log, "w") as sink:
        proc = subprocess.Popen([sys.executable, "-c", _MEASURED, *argv], cwd=work, env=env, stdout=subprocess.PIPE,
                                stderr=sink, text=True, start_new_session=True)
        while proc.poll() is None:
            tree_peak = max(tree_peak, _tree_rss(proc.pid))
            if (available := psutil.virtual_memory().available) < floor_gb * 2 ** 30:
                stopped = round(available / 2 ** 30, 2)
                os.killpg(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.5)
        out = proc.communicate()[0]
    shutil.rmtree(tmp, ignore_errors=True)
    sampled = {"tree_rss_peak_gb_sampled": round(tree_peak / 2 ** 30, 2)}
    if stopped is not None:
        return {"rc": -9, "seconds": round(time.monotonic() - start, 1), "stopped_at_available_gb": stopped,
                **sampled}
    lines = out.strip().splitlines()
    log.with_suffix(".out").write_text("\n".join(lines[:-1]))
    return {**json.loads(lines[-1]), **sampled}


def _stage_figures(stage: str, work: Path) -> dict:
    """What a stage's report (or output) says of its phases: peak RSS by phase, seconds."""
    report = work / "reports" / f"{stage}.json"
    data = json.loads(report.read_text()) if report.is_file() else {}
    if stage == "train":
        return {"peak_rss_mb_by_phase": data.get("peak_rss_mb_by_phase")}
    if stage == "export":  # its own seconds by phase apart from the stage's wall time
        return {("report_seconds" if k == "seconds" else k): data[k]
                for k in ("memory_peak_mb", "seconds", "size_mb", "parity") if k in data}
    if stage == "evaluate":
        return {"memory": data.get("memory"), "metrics": data.get("metrics"),
                "base_cache": (data.get("generation") or {}).get("base_cache")}
    out = work / f"{stage}.out"  # measured() writes the stage's stdout there
    lines = out.read_text().strip().splitlines() if out.is_file() else []
    try:
        return json.loads(lines[-1]) if stage in ("predict", "serve") and lines else {}
    except json.JSONDecodeError:
        return {}


def command(stage: str, serve_size: int | None = None) -> list[str]:
    """The command that runs `stage` in the work clone; `serve_size`: the px predict and serve ask for
    (None: the registered model's default size)."""
    if stage == "ingest":  # with the data_manifest stage it depends on (rewritten by every repro)
        return ["dvc", "repro", stage]
    if stage in STAGES:
        return ["dvc", "repro", "-s", stage]
    size = {"height": serve_size, "width": serve_size} if serve_size else {}
    return {"register": [sys.executable, "-m", "tasks.register", "--finetuned", "models/finetuned", "--openvino",
                         "models/openvino", "--evaluation", "reports/evaluate.json", "--base", "models/base"],
            "predict": [sys.executable, "-c", _PREDICT.replace("__SIZE__", repr(size))],
            "serve": [sys.executable, "-m", "benchmarks.flux2_klein.serve_once", MODEL_URI,
                      *(["--size", str(serve_size)] if serve_size else [])]}[stage]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path, default=ROOT / ".cache/bench/flux2-klein-4b")
    parser.add_argument("--work", type=Path, default=ROOT / ".cache/bench/flux2-klein-chain")
    parser.add_argument("--results", type=Path, default=HERE / "results_chain.json")
    parser.add_argument("--floor-gb", type=float, default=0.8, help="stop a stage when less memory is available")
    parser.add_argument("--stages", nargs="+", choices=[*STAGES, *AFTER], default=[*STAGES, *AFTER],
                        help="the stages to run, in the chain's order (default: all, then register, predict, serve)")
    parser.add_argument("--serve-size", type=int, default=None,
                        help="px that predict and serve ask for (default: the registered model's own size)")
    parser.add_argument("--resume", action="store_true",
                        help="go on in --work's clone (HEAD's code pulled into it, its outputs kept); the rows of "
                             "--results for stages not run again are kept")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", dest="sets",
                        help="a params.yaml key set after the chain's own (value read as YAML); repeatable")
    args = parser.parse_args()
    overrides = parse_sets(args.sets)
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"  # this venv's dvc
    if not (args.base / "model_index.json").is_file():
        raise SystemExit(f"{args.base} is missing: run `.venv/bin/python -m benchmarks.flux2_klein.build`")
    (resume if args.resume else prepare)(args.base.resolve(), args.work, overrides)
    rows = []
    for stage in [s for s in [*STAGES, *AFTER] if s in args.stages]:
        row = {"stage": stage, **measured(command(stage, args.serve_size), args.work, args.work / f"{stage}.log",
                                          args.floor_gb)}
        row.update(_stage_figures(stage, args.work))
        if row["rc"] != 0:
            row["error"] = (args.work / f"{stage}.log").read_text()[-2000:]
        print(json.dumps(row), flush=True)
        rows.append(row)
        if row["rc"] != 0:
            break
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=args.work, capture_output=True, text=True).stdout.strip()
    result = {"date": time.strftime("%Y-%m-%d"), "commit": commit, "params": PARAMS,
              "stages_asked": [s for s in [*STAGES, *AFTER] if s in args.stages],
              **({"overrides": overrides} if overrides else {})}
    if args.resume and args.results.is_file():  # the earlier rows first, each with the commit it ran at
        earlier = json.loads(args.results.read_text())
        ran = {row["stage"] for row in rows}
        rows = [{"commit": earlier["commit"], **row} for row in earlier["stages"] if row["stage"] not in ran] + [
            {"commit": commit, **row} for row in rows]
        result["resumed_from"] = {k: earlier.get(k) for k in ("date", "commit", "stages_asked", "overrides")}
        result["replaced"] = [row for row in earlier["stages"] if row["stage"] in ran]  # what they were before
    result["stages"] = rows
    args.results.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
