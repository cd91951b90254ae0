"""The XLA and Intel Extension back ends, run for real in their side environments.

torch_xla 2.9 needs torch 2.9 and intel_extension_for_pytorch 2.8 needs torch 2.8, while the
project runs torch 2.15: `make side-envs` builds `.venv-xla` and `.venv-ipex` with those pairs and
the project's other pinned packages (`make test` builds them first). Each test runs the real
`python -m tasks.train` with the side environment's interpreter for a few steps on a tiny model;
without the environment it skips, naming the command that builds it.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO
from tests.train.conftest import write_imagefolder

UNET = "unet/diffusion_pytorch_model.safetensors"


def side_python(name: str) -> Path:
    python = REPO / f".venv-{name}" / "bin" / "python"
    if not (REPO / f".venv-{name}" / ".installed").is_file():
        pytest.skip(f".venv-{name} is not built: run `make side-envs` (it installs torch with "
                    f"{'torch_xla' if name == 'xla' else 'intel_extension_for_pytorch'}; about 11 GB "
                    "for both side environments)")
    return python


def run_train(python: Path, tmp_path: Path, base: Path, section: dict, env: dict[str, str]) -> tuple[str, dict, Path]:
    """`python -m tasks.train` in `tmp_path` with `section` as params; (stderr, report, output folder)."""
    data = write_imagefolder(tmp_path / "processed", 2, "a photo of sks toy", 0, size=(32, 32))
    classes = write_imagefolder(tmp_path / "class_images", 2, "a photo of a toy", 2, size=(32, 32))
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"train": {
        "resolution": 32, "train_batch_size": 2, "max_train_steps": 3, "checkpointing_steps": 10_000,
        "checkpoints_dir": str(tmp_path / "ckpt"), "num_validation_images": 1, "validation_inference_steps": 1,
        "system_metrics_interval": 0, **section}}))
    out, report = tmp_path / "finetuned", tmp_path / "train.json"
    proc = subprocess.run(
        [str(python), "-m", "tasks.train", "--base", str(base), "--data", str(data), "--class-data", str(classes),
         "--out", str(out), "--report", str(report), "--plot", str(tmp_path / "loss.csv"), "--params", str(params)],
        cwd=tmp_path, capture_output=True, text=True, timeout=1800,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **env},
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    return proc.stderr, json.loads(report.read_text()), out


def assert_trained_output_loads(out: Path, base: Path) -> None:
    """The output is a complete pipeline whose UNet differs from the base's (in this, the main, env)."""
    from diffusers import DiffusionPipeline
    from safetensors.torch import load_file

    DiffusionPipeline.from_pretrained(out)
    trained, before = load_file(out / UNET), load_file(base / UNET)
    assert trained.keys() == before.keys()
    assert all(t.dtype == before[k].dtype for k, t in trained.items()), "weights saved in the base's precision"
    assert any(not (trained[k].float() == before[k].float()).all() for k in trained), "the UNet did not change"


def test_xla_spmd_trains_tiny_sdxl_with_the_batch_sharded(tmp_path, tiny_sdxl) -> None:
    python = side_python("xla")
    section = {"gradient_checkpointing": True, "mixed_precision": "bf16",
               "xla": {"compile_cache_dir": str(tmp_path / "xla-cache"), "profile_dir": str(tmp_path / "profile"),
                       "profile_start_step": 2, "profile_steps": 1}}
    # Four PJRT CPU devices: the batch (2 instance + 2 class images) is split one image per device.
    # XLA's CPU code generator at optimization level 0: the test proves the sharding, checkpointing,
    # compile cache and profile, not the CPU code's speed; LLVM's optimizing passes were 40% of
    # the test's CPU time (200 s -> 118 s measured, 2026-11-28), and the CPU stands in for a TPU.
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()
    log, report, out = run_train(python, tmp_path, tiny_sdxl, section,
                                 {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4", "XLA_FLAGS": flags})
    assert "back end: xla (PJRT CPU, 4 devices, SPMD mesh {'data': 4}" in log, log[-3000:]
    assert "devices=[4,1,1,1]" in log, "the images arrive sharded over the 4 devices"
    assert "gradient checkpointing of" in log
    assert report["family"] == "sdxl" and report["steps"] == 3 and math.isfinite(report["final_loss"])
    assert any((tmp_path / "xla-cache").iterdir()), "compiled graphs persist in the compile cache"
    assert any(p.is_file() for p in (tmp_path / "profile").rglob("*")), "the profile window wrote a trace"
    assert_trained_output_loads(out, tiny_sdxl)


def test_ipex_optimize_trains_tiny_sd_in_bf16(tmp_path, tiny_sd) -> None:
    python = side_python("ipex")
    log, report, out = run_train(python, tmp_path, tiny_sd, {"mixed_precision": "bf16", "cpu_backend": "ipex"}, {})
    # the text encoder is gone by then: its embeddings are cached and it is released before the first step
    assert ("CPU back end: ipex, ipex.optimize(unet with the optimizer, float32 weights; vae for "
            "inference, dtype=bfloat16) + bf16 autocast") in log, log[-3000:]
    assert report["family"] == "sd" and report["steps"] == 3 and math.isfinite(report["final_loss"])
    assert_trained_output_loads(out, tiny_sd)


def test_cpu_backend_choice_in_the_main_environment() -> None:
    """Here (torch 2.15, no IPEX for it): auto falls back to native autocast; ipex fails naming the fix."""
    from tasks.common.errors import UserError
    from tasks.train.config import TrainConfig
    from tasks.train.cpu_accel import NativeCpuBackend, choose_cpu_backend, ipex_status

    module, why = ipex_status()
    if module is not None:
        pytest.skip(f"this environment has a working IPEX ({why})")
    backend = choose_cpu_backend(TrainConfig(cpu_backend="auto"), "bf16")
    assert isinstance(backend, NativeCpuBackend) and backend.why.startswith("auto: intel_extension_for_pytorch")
    with pytest.raises(UserError, match="make side-envs"):
        choose_cpu_backend(TrainConfig(cpu_backend="ipex"), "bf16")
