"""Stage `class_images`: fixed seeds per image, resumable, stale images replaced, CLI + MLflow."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from tasks.class_images.config import ClassImagesConfig
from tasks.class_images.core import METADATA, STATE, generate, run, shard
from tasks.common.config import parse_section
from tasks.common.errors import UserError
from tests.conftest import REPO, stage_runs

FAST = dict(prompt="a photo of a toy", resolution=64, num_inference_steps=2, guidance_scale=7.5, seed=3)


def cfg(**kw) -> ClassImagesConfig:
    return ClassImagesConfig(**{**FAST, "num_images": 3, "batch_size": 2, **kw})


def pixels(path: Path) -> np.ndarray:
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"), dtype=np.int16)


def listing(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in sorted(folder.iterdir()) if p.suffix == ".png"}


def test_generates_then_reuses(tmp_path: Path, tiny_sd: Path, tiny_pipe) -> None:
    out = tmp_path / "cls"
    first = run(cfg(), tiny_sd, out, pipe=tiny_pipe)
    assert (first.generated, first.reused, first.removed) == (3, 0, 0)
    files = listing(out)
    assert list(files) == ["00000.png", "00001.png", "00002.png"]
    rows = [json.loads(line) for line in (out / METADATA).read_text().splitlines()]
    assert rows == [{"file_name": f"0000{i}.png", "text": "a photo of a toy"} for i in range(3)]
    for name in files:
        with Image.open(out / name) as im:
            assert im.size == (64, 64) and im.mode == "RGB"
    assert len({pixels(out / n).tobytes() for n in files}) == 3, "each index has its own seed"

    second = run(cfg(), tiny_sd, out, pipe=tiny_pipe)
    assert (second.generated, second.reused, second.removed) == (0, 3, 0)
    assert listing(out) == files, "reused images must not be rewritten"
    assert second.report()["generated"] == 0 and second.report()["reused"] == 3


def test_image_is_the_same_alone_or_in_a_batch(tmp_path: Path, tiny_pipe) -> None:
    generate(tiny_pipe, cfg(batch_size=3), [0, 1, 2], tmp_path / "batched")
    generate(tiny_pipe, cfg(batch_size=1), [2], tmp_path / "alone")
    batched, alone = pixels(tmp_path / "batched" / "00002.png"), pixels(tmp_path / "alone" / "00002.png")
    # Same seed, same noise; batched matmuls may round differently in the last bit of a float,
    # which can move a pixel by one level at most.
    diff = np.abs(batched - alone)
    assert diff.max() <= 1 and (diff > 0).mean() < 0.01


def test_fewer_images_removes_extras_and_broken_images_are_regenerated(
        tmp_path: Path, tiny_sd: Path, tiny_pipe) -> None:
    out = tmp_path / "cls"
    run(cfg(num_images=3), tiny_sd, out, pipe=tiny_pipe)
    kept = pixels(out / "00000.png")
    fewer = run(cfg(num_images=2), tiny_sd, out, pipe=tiny_pipe)
    assert (fewer.generated, fewer.reused, fewer.removed) == (0, 2, 1)
    assert sorted(listing(out)) == ["00000.png", "00001.png"]
    assert len((out / METADATA).read_text().splitlines()) == 2

    data = (out / "00001.png").read_bytes()
    (out / "00001.png").write_bytes(data[: len(data) // 2])  # a truncated file, as a crash would leave
    (out / ".00002.png.tmp-abc.png").write_bytes(b"partial")  # a killed run's temporary
    again = run(cfg(num_images=2), tiny_sd, out, pipe=tiny_pipe)
    assert (again.generated, again.reused) == (1, 1)
    assert sorted(p.name for p in out.iterdir()) == sorted(["00000.png", "00001.png", METADATA, STATE])
    assert np.array_equal(pixels(out / "00000.png"), kept)


def test_images_the_stage_did_not_make_are_never_replaced(tmp_path: Path, tiny_sd: Path, tiny_pipe) -> None:
    """Without the stage's generation.json (its marker) a folder's 00000.png is someone else's."""
    out = tmp_path / "photos"
    out.mkdir()
    (out / "00000.png").write_bytes(b"my holiday")
    (out / ".notes.tmp-1").write_text("mine")
    with pytest.raises(UserError, match=r"00000\.png.*no generation\.json.*did not make them"):
        run(cfg(num_images=2), tiny_sd, out, pipe=tiny_pipe)
    assert (out / "00000.png").read_bytes() == b"my holiday" and (out / ".notes.tmp-1").is_file()


def test_other_settings_make_old_images_stale(tmp_path: Path, tiny_sd: Path, tiny_pipe) -> None:
    out = tmp_path / "cls"
    run(cfg(num_images=2), tiny_sd, out, pipe=tiny_pipe)
    before = pixels(out / "00000.png")
    changed = run(cfg(num_images=2, prompt="a photo of a dog"), tiny_sd, out, pipe=tiny_pipe)
    assert (changed.generated, changed.reused) == (2, 0)
    assert not np.array_equal(pixels(out / "00000.png"), before)
    assert json.loads((out / STATE).read_text())["prompt"] == "a photo of a dog"
    # batch_size and num_images do not change the pixels: nothing is regenerated for them.
    assert run(cfg(num_images=2, prompt="a photo of a dog", batch_size=1), tiny_sd, out, pipe=tiny_pipe).generated == 0


def test_sdxl_base(tmp_path: Path) -> None:
    from tasks.common.families import build_tiny_pipeline

    base = build_tiny_pipeline("builtin:tiny-sdxl", 0, tmp_path / "tiny-sdxl")
    summary = run(cfg(num_images=2), base, tmp_path / "cls")
    assert summary.generated == 2
    with Image.open(tmp_path / "cls" / "00001.png") as im:
        assert im.size == (64, 64)


def test_zero_images_and_missing_base(tmp_path: Path, tiny_sd: Path) -> None:
    empty = run(cfg(num_images=0), tiny_sd, tmp_path / "cls")
    assert empty.generated == 0 and (tmp_path / "cls" / METADATA).read_text() == ""
    with pytest.raises(UserError, match="base"):
        run(cfg(), tmp_path / "nope", tmp_path / "cls2")


def test_shard_splits_indices_round_robin() -> None:
    shards = [shard(list(range(10)), r, 3) for r in range(3)]
    assert shards == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    with pytest.raises(ValueError):
        shard([1], 3, 3)


def test_config_errors_name_the_key() -> None:
    with pytest.raises(UserError, match=r"class_images\.resolution"):
        parse_section("class_images", {"resolution": 60}, ClassImagesConfig)
    with pytest.raises(UserError, match=r"class_images\.num_image: unknown key"):
        parse_section("class_images", {"num_image": 3}, ClassImagesConfig)
    with pytest.raises(UserError, match=r"negative_prompt is set, but guidance_scale <= 1 turns .* off"):
        parse_section("class_images", {"negative_prompt": "blurry", "guidance_scale": 1.0}, ClassImagesConfig)
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    parse_section("class_images", params["class_images"], ClassImagesConfig)  # the shipped section is valid


def test_cli_writes_outputs_and_logs(tmp_path: Path, tiny_sd: Path, isolated_mlflow: str) -> None:
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"class_images": {**FAST, "num_images": 2, "batch_size": 2}}))
    cmd = [sys.executable, "-m", "tasks.class_images", "--base", str(tiny_sd), "--out", str(tmp_path / "cls"),
           "--report", str(tmp_path / "reports" / "class_images.json"), "--params", str(params)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "reports" / "class_images.json").read_text())
    assert report["num_images"] == 2 and report["generated"] == 2 and report["reused"] == 0
    runs = stage_runs(isolated_mlflow)
    assert [r.data.tags["stage"] for r in runs] == ["class_images"]
    assert runs[0].data.metrics["generated"] == 2 and runs[0].data.params["prompt"] == "a photo of a toy"
    from mlflow.tracking import MlflowClient

    artifacts = {a.path for a in MlflowClient(tracking_uri=isolated_mlflow).list_artifacts(runs[0].info.run_id)}
    assert {"class_images_grid.png", "class_images.json", METADATA} <= artifacts
    assert sorted(p.name for p in (tmp_path / "cls").glob("*.png")) == ["00000.png", "00001.png"]


def test_without_prior_preservation_it_makes_none_and_loads_nothing(tmp_path: Path, isolated_mlflow: str) -> None:
    """train.with_prior_preservation: false (the edit recipe's): no class image is made, no model loads
    (the base folder is not even there), the images an earlier run made stay for a later one."""
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"class_images": {**FAST, "num_images": 8},
                                      "train": {"with_prior_preservation": False}}))
    (tmp_path / "cls").mkdir()
    Image.new("RGB", (32, 32)).save(tmp_path / "cls" / "00000.png")
    done = subprocess.run(
        [sys.executable, "-m", "tasks.class_images", "--base", str(tmp_path / "missing"), "--out",
         str(tmp_path / "cls"), "--report", str(tmp_path / "r.json"), "--params", str(params)],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report == {"skipped": True, "reason": "train.with_prior_preservation: false", "num_images": 0,
                      "generated": 0, "kept_unused": 1}
    assert "no class images (train.with_prior_preservation: false" in done.stderr + done.stdout
    assert [p.name for p in (tmp_path / "cls").iterdir()] == ["00000.png"]
    assert [r.data.tags["class_images.skipped"] for r in stage_runs(isolated_mlflow)] == ["true"]


def test_prior_preservation_beside_an_edit_dataset_is_refused_before_any_image(tmp_path: Path) -> None:
    """Under a plain dvc repro the flow's up-front check has not run: class_images refuses what the train
    stage would refuse after it (class images have no reference images), before making any."""
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"class_images": {**FAST, "num_images": 8},
                                      "ingest": {"sources": [{"type": "folder", "control_dir": "control"}]}}))
    done = subprocess.run(
        [sys.executable, "-m", "tasks.class_images", "--base", str(tmp_path / "missing"), "--out",
         str(tmp_path / "cls"), "--report", str(tmp_path / "r.json"), "--params", str(params)],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=tmp_path,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "train.with_prior_preservation: true beside an edit dataset (ingest.sources[0].control_dir" in done.stderr
    assert not (tmp_path / "cls").exists() and not (tmp_path / "r.json").exists()


def test_cli_bad_base_is_a_clean_error(tmp_path: Path) -> None:
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"class_images": {**FAST, "num_images": 1}}))
    done = subprocess.run(
        [sys.executable, "-m", "tasks.class_images", "--base", str(tmp_path / "missing"), "--out",
         str(tmp_path / "cls"), "--report", str(tmp_path / "r.json"), "--params", str(params)],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=tmp_path,
    )
    assert done.returncode == 2 and "run the `base` stage" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "r.json").exists()


def test_precision_follows_the_stored_weights_and_is_part_of_the_key(tmp_path: Path, tiny_sd: Path,
                                                                     monkeypatch) -> None:
    """auto: a base stored in fp32 (SD 1.x, the tiny models) generates in fp32, one stored in bf16
    (FLUX, SD3.5 releases) in bf16, half the memory, on a CPU that computes bf16 natively (flags
    faked: AMX); the precision made is part of the images' key."""
    import shutil

    import torch
    from diffusers import UNet2DConditionModel

    from tasks.class_images.core import generation_key, load_pipeline, pipeline_dtype

    monkeypatch.setenv("FINETUNE_CPU_FLAGS", "avx2 avx512f avx512_bf16 amx_bf16")
    assert pipeline_dtype(tiny_sd, "cpu") == torch.float32
    assert pipeline_dtype(tiny_sd, "cpu", "bf16") == torch.bfloat16
    assert pipeline_dtype(tiny_sd, "cuda") == torch.float16  # decided from the device alone: no GPU needed
    stored_bf16 = tmp_path / "bf16-base"
    shutil.copytree(tiny_sd, stored_bf16)
    unet = UNet2DConditionModel.from_pretrained(tiny_sd / "unet")
    shutil.rmtree(stored_bf16 / "unet")
    unet.to(torch.bfloat16).save_pretrained(stored_bf16 / "unet")
    assert pipeline_dtype(stored_bf16, "cpu") == torch.bfloat16
    pipe = load_pipeline(stored_bf16, "cpu")
    assert pipe.unet.dtype == torch.bfloat16 and pipe.text_encoder.dtype == torch.bfloat16
    summary = run(cfg(num_images=1), stored_bf16, tmp_path / "cls", pipe=pipe)
    assert summary.generated == 1 and pixels(tmp_path / "cls" / "00000.png").shape == (64, 64, 3)
    assert json.loads((tmp_path / "cls" / STATE).read_text())["precision"] == "bf16", "auto made bf16: in the key"
    assert generation_key(cfg(precision="auto"), "f") == generation_key(cfg(precision="fp32"), "f")
    assert generation_key(cfg(precision="bf16"), "f") == {**generation_key(cfg(), "f"), "precision": "bf16"}

    # An AVX2-only CPU (EPYC Rome/Milan) would emulate bf16: auto makes fp32, an explicit bf16 is refused
    monkeypatch.setenv("FINETUNE_CPU_FLAGS", "avx avx2 fma")
    assert pipeline_dtype(stored_bf16, "cpu") == torch.float32
    assert pipeline_dtype(stored_bf16, "cuda") == torch.float16
    with pytest.raises(UserError, match=r"class_images.precision: bf16 on a CPU without native bf16 \(AVX2.*"
                                        r"about 500x slower than fp32.*Set class_images.precision: auto or fp32"):
        run(cfg(num_images=1, precision="bf16"), stored_bf16, tmp_path / "refused")
    assert not (tmp_path / "refused").exists(), "refused before anything is written"


def test_a_quantized_denoiser_makes_the_class_images_under_its_own_key(tmp_path: Path, tiny_sd: Path) -> None:
    """class_images.base_model_precision: the denoiser's Linear layers quantized as they load (the
    train stage's path), the rest of the pipeline as before; the precision is part of the images' key."""
    from tasks.class_images.core import generation_key, load_pipeline
    from tasks.common.quantize import BasePrecision, has_quantized

    pipe = load_pipeline(tiny_sd, "cpu", quantize=BasePrecision.parse("int8"))
    assert has_quantized(pipe.unet) and not has_quantized(pipe.text_encoder) and not has_quantized(pipe.vae)
    summary = run(cfg(num_images=2, base_model_precision="int8"), tiny_sd, tmp_path / "cls", pipe=pipe)
    assert summary.generated == 2
    full = run(cfg(num_images=2), tiny_sd, tmp_path / "full")
    assert summary.generated == full.generated == 2
    for name in ("00000.png", "00001.png"):  # the same noise, the weights rounded to 8 bits: close, not equal
        quantized, exact = pixels(tmp_path / "cls" / name), pixels(tmp_path / "full" / name)
        assert quantized.shape == exact.shape == (64, 64, 3) and 0 < np.abs(quantized - exact).mean() < 16
    key = generation_key(cfg(base_model_precision="int8"), "f")
    assert key == {**generation_key(cfg(), "f"), "base_model_precision": "int8-torchao"}
    assert key == generation_key(cfg(base_model_precision="int8-torchao"), "f")
    assert generation_key(cfg(base_model_precision="none"), "f") == generation_key(cfg(), "f")


def test_the_precision_follows_the_train_stage_unless_set() -> None:
    from tasks.common.quantize import following_train

    params = {"train": {"base_model_precision": "nf4"}}
    assert following_train("class_images", cfg(), params).base_model_precision == "nf4"
    assert following_train("class_images", cfg(base_model_precision="none"), params).base_model_precision == "none"
    assert following_train("class_images", cfg(), {}).base_model_precision == "none"
    with pytest.raises(UserError, match=r"class_images.base_model_precision is null, so it follows "
                                        r"train.base_model_precision: 'int4' is not one of"):
        following_train("class_images", cfg(), {"train": {"base_model_precision": "int4"}})
    with pytest.raises(UserError, match=r"class_images: Value error, base_model_precision: 'int4' is not one of"):
        parse_section("class_images", {"base_model_precision": "int4"}, ClassImagesConfig)


def test_vae_decode_sliced_keeps_the_images_tiled_makes_its_own(tmp_path: Path, tiny_sd: Path) -> None:
    """class_images.vae_decode: sliced decoding (auto's at this size) keeps the key and the images;
    tiled is part of the key; a VAE without the asked mode is refused by name, decoded whole under auto."""
    from types import SimpleNamespace

    from tasks.class_images.core import load_pipeline, set_vae_decode, vae_decode

    pipe, out = load_pipeline(tiny_sd), tmp_path / "cls"
    assert run(cfg(vae_decode="full"), tiny_sd, out, pipe=pipe).generated == 3
    whole = pixels(out / "00001.png")
    sliced = tmp_path / "sliced"
    run(cfg(), tiny_sd, sliced, pipe=pipe)  # auto: sliced at 64 px
    assert pipe.vae.use_slicing and not pipe.vae.use_tiling
    assert run(cfg(), tiny_sd, out, pipe=pipe).generated == 0  # the key is full's
    assert "vae_decode" not in json.loads((out / STATE).read_text())
    diff = np.abs(pixels(sliced / "00001.png") - whole)  # image 1 of a batch of 2, decoded alone
    assert diff.max() <= 1 and (diff > 0).mean() < 0.01

    tiled = run(cfg(vae_decode="tiled"), tiny_sd, out, pipe=pipe)
    assert tiled.generated == 3 and pipe.vae.use_tiling
    assert json.loads((out / STATE).read_text())["vae_decode"] == "tiled"

    assert vae_decode(cfg(resolution=2048)) == "tiled" and vae_decode(cfg(resolution=1024)) == "sliced"
    no_tiles = SimpleNamespace(vae=object())
    with pytest.raises(UserError, match=r"vae_decode: tiled: this base's VAE \(object\) has no tiled decoding"):
        set_vae_decode(no_tiles, cfg(vae_decode="tiled"))
    set_vae_decode(no_tiles, cfg(resolution=2048))  # auto: decodes whole
