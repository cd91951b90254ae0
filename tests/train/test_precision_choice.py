"""train.mixed_precision: auto trains in bf16 only on a CPU that computes it natively, fp32 where it
would be emulated; an explicit bf16 there is refused before anything loads. The CPU flags are faked
both ways (FINETUNE_CPU_FLAGS, finetune_runtime/cpu_formats.py)."""
from __future__ import annotations

import pytest
import yaml

from finetune_runtime import cpu_formats as C
from tasks.common.config import parse_section
from tasks.common.errors import UserError
from tasks.train.config import TrainConfig
from tasks.train.core import train

AMX = C.detect(["avx2", "avx512f", "avx512_bf16", "amx_bf16"], "AVX512")
AVX2 = C.detect(["avx", "avx2", "fma"], "AVX2")


def test_auto_follows_the_cpus_native_formats() -> None:
    auto = TrainConfig(mixed_precision="auto")
    cfg, choice = auto.with_precision_chosen("cpu", AMX)
    assert cfg.mixed_precision == "bf16" and choice.precision == "bf16" and "natively" in choice.why
    cfg, choice = auto.with_precision_chosen("cpu", AVX2)
    assert cfg.mixed_precision == "no" and "no native bf16 (AVX2)" in choice.why
    assert auto.with_precision_chosen("cuda", AVX2)[0].mixed_precision == "no", "a GPU: fp32 as before"
    assert auto.mixed_precision == "auto", "the config itself is left as it was"
    for value in ("no", "bf16"):
        cfg, choice = TrainConfig(mixed_precision=value).with_precision_chosen("cpu", AMX)
        assert cfg.mixed_precision == value and choice.why.startswith(f"train.mixed_precision: {value}, on AVX512")


def test_explicit_bf16_on_an_emulating_cpu_is_refused_with_the_cost_and_the_fix() -> None:
    with pytest.raises(UserError) as err:
        TrainConfig(mixed_precision="bf16").with_precision_chosen("cpu", AVX2)
    text = str(err.value)
    assert text.startswith("params.yaml: train.mixed_precision: bf16 on a CPU without native bf16 (AVX2")
    assert "about 500x slower than fp32" in text and "0.3 GFLOP/s" in text
    assert text.endswith("Set train.mixed_precision: auto or no (fp32).")
    assert TrainConfig(mixed_precision="bf16").with_precision_chosen("cuda", AVX2)[0].mixed_precision == "bf16"
    assert TrainConfig(mixed_precision="no").with_precision_chosen("cpu", AVX2)[0].mixed_precision == "no"


def test_refused_before_the_base_loads(tmp_path, tiny_sd, instance_dir, monkeypatch) -> None:
    monkeypatch.setenv(C.FLAGS_ENV, "avx avx2 fma")
    cfg = TrainConfig(method="lora", max_train_steps=1, mixed_precision="bf16", checkpoints_dir=tmp_path / "ckpt")
    with pytest.raises(UserError, match="train.mixed_precision: bf16 on a CPU without native bf16"):
        train(cfg, tiny_sd, instance_dir, None, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("flags, ran", [("avx avx2 fma", "no"), (None, None)], ids=["avx2-faked", "this-cpu"])
def test_the_report_says_which_precision_ran_and_why(tmp_path, tiny_sd, instance_dir, monkeypatch, caplog,
                                                     flags, ran) -> None:
    """A real tiny LoRA run with auto, its section read as params.yaml's is: on a faked AVX2-only CPU
    it trains in fp32; on this CPU, in bf16 where it has native bf16 (AMX here), else fp32."""
    if flags is None:
        monkeypatch.delenv(C.FLAGS_ENV, raising=False)
        ran = "bf16" if C.detect().bf16 else "no"
    else:
        monkeypatch.setenv(C.FLAGS_ENV, flags)
    section = yaml.safe_load(f"""
        method: lora
        mixed_precision: auto
        max_train_steps: 1
        train_batch_size: 1
        resolution: 32
        num_validation_images: 0
        with_prior_preservation: false
        checkpoints_dir: {tmp_path / "ckpt"}
    """)
    cfg = parse_section("train", section, TrainConfig)
    with caplog.at_level("INFO", logger="tasks.train.core"):
        report = train(cfg, tiny_sd, instance_dir, None, tmp_path / "out").report()
    assert report["mixed_precision"] == ran
    assert report["precision_why"].startswith("auto: this CPU " + ("computes bf16 natively" if ran == "bf16"
                                                                   else "has no native bf16"))
    assert f"train.mixed_precision: {ran} (auto: this CPU" in caplog.text
