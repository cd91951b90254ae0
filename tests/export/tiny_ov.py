"""Tiny pipelines exported once per test session, shared by the export and evaluate tests.

Exporting takes ~15-40 s even for the tiny models (torch tracing + OpenVINO conversion), so each
(kind, shape) is exported once into the session's base temp folder and reused from disk by any
test module that asks for it.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from PIL import Image, ImageDraw

PARITY_FAST = {"num_inference_steps": 2}


def tiny_pipeline(tmp_path_factory: pytest.TempPathFactory, kind: str, seed: int = 0) -> Path:
    """builtin:tiny-sd / builtin:tiny-sdxl saved once per session."""
    from tasks.common.families import build_tiny_pipeline

    path = tmp_path_factory.getbasetemp() / "tiny-pipelines" / f"{kind.split(':')[1]}-{seed}"
    if not (path / "model_index.json").is_file():
        build_tiny_pipeline(kind, seed, path)
    return path


def bf16_unet_pipeline(tmp_path_factory: pytest.TempPathFactory, dst: Path) -> Path:
    """builtin:tiny-sd copied to `dst` with its UNet stored in bf16 (a base stored in 16 bits)."""
    import shutil

    import torch
    from diffusers import UNet2DConditionModel

    shutil.copytree(tiny_pipeline(tmp_path_factory, "builtin:tiny-sd"), dst)
    unet = UNet2DConditionModel.from_pretrained(dst / "unet")
    shutil.rmtree(dst / "unet")
    unet.to(torch.bfloat16).save_pretrained(dst / "unet")
    return dst


def exported(
    tmp_path_factory: pytest.TempPathFactory, kind: str, **shape: Any
) -> tuple[Path, Path, dict[str, Any]]:
    """(source pipeline, OpenVINO folder, export report) for `kind` at `shape`, once per session."""
    from tasks.export.config import ExportConfig
    from tasks.export.core import export

    src = tiny_pipeline(tmp_path_factory, kind)
    cfg = ExportConfig(**shape, parity=PARITY_FAST)
    key = "-".join([kind.split(":")[1]] + [f"{k}{v}" for k, v in sorted(shape.items())])
    out = tmp_path_factory.getbasetemp() / "tiny-openvino" / key
    report_path = out.with_suffix(".json")
    if not report_path.is_file():
        report = export(src, out, cfg)
        report_path.write_text(json.dumps(report))
    return src, out, json.loads(report_path.read_text())


def runtime_export(tmp_path_factory: pytest.TempPathFactory, name: str, seed: int,
                   text_encoder: bool = False) -> tuple[Path, Path, dict[str, Any]]:
    """(LoRA folder, `export.adapters: runtime` export, report) of a hand-made LoRA `name` on
    tiny-sd at 64 px, 2 images per call, once per session; every one shares the session's base cache."""
    from tasks.export.config import ExportConfig
    from tasks.export.runtime import export_runtime
    from tests.export.adapters import write_adapters

    base = tiny_pipeline(tmp_path_factory, "builtin:tiny-sd")
    root = tmp_path_factory.getbasetemp() / "tiny-runtime"
    lora, out = root / f"lora-{name}", root / f"export-{name}"
    report_path = out.with_suffix(".json")
    if not report_path.is_file():
        write_adapters(base, lora, embeds=False, seed=seed, text_encoder=text_encoder)
        cfg = ExportConfig(adapters="runtime", num_images_per_prompt=2, parity=PARITY_FAST,
                           base_cache_dir=str(root / "base-cache"))
        out.mkdir(parents=True)
        report_path.write_text(json.dumps(export_runtime(lora, out, cfg, base)))
    return lora, out, json.loads(report_path.read_text())


def write_subject_images(folder: Path, n: int = 4, size: int = 64) -> Path:
    """`n` drawn pictures of one 'subject' (a coloured disc on a background) + metadata.jsonl."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        im = Image.new("RGB", (size, size), (40 + 30 * i, 120, 200 - 20 * i))
        draw = ImageDraw.Draw(im)
        r = size // 4 + i
        c = size // 2 + (i - n // 2) * 3
        draw.ellipse((c - r, c - r, c + r, c + r), fill=(230, 60, 40), outline=(0, 0, 0))
        name = f"subject_{i:02d}.png"
        im.save(folder / name)
        rows.append({"file_name": name, "text": "a photo of sks toy"})
    (folder / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder
