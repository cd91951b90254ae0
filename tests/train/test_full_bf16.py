"""full_bf16: the trained weights held in bf16 and updated by AdamW with stochastic rounding
(tasks/train/bf16_adamw.py), refused where it cannot work, and what it trains saved in float32."""
from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file

from tasks.train.bf16_adamw import StochasticAdamW, _hash_bits
from tasks.train.config import TrainConfig, cxx_compiler
from tasks.train.core import train

UNET = "unet/diffusion_pytorch_model.safetensors"
needs_compiler = pytest.mark.skipif(cxx_compiler() is None, reason="torch.compile needs a C++ compiler: apt-get "
                                    "install g++ (.ci/run installs it)")


def test_the_rounding_bits_are_uniform() -> None:
    bits = _hash_bits(torch.arange(1_000_000, dtype=torch.int32), torch.tensor(7, dtype=torch.int32)).double()
    assert bits.min() >= 0 and bits.max() <= 0xFFFF
    counts = torch.histc(bits, 16, 0, 65536)
    assert (counts / counts.mean() - 1).abs().max() < 0.02, counts


@pytest.mark.parametrize("fused", [pytest.param(True, marks=needs_compiler), False])
def test_stochastic_rounding_follows_float32_adamw_where_rounding_to_nearest_stands_still(fused) -> None:
    """200 steps at a learning rate of 5e-6 on weights of about 0.05 (a bf16 step there is 2.4e-4): the
    bf16 weights move as far as float32 AdamW's, and stay near them; rounding to nearest loses nearly
    every update."""
    torch.manual_seed(0)
    start = torch.randn(20_000) * 0.05
    ref = torch.nn.Parameter(start.clone())
    sr = torch.nn.Parameter(start.bfloat16())
    nearest = torch.nn.Parameter(start.bfloat16())
    optimizers = [torch.optim.AdamW([ref], lr=5e-6), StochasticAdamW([sr], lr=5e-6, fused=fused),
                  torch.optim.AdamW([nearest], lr=5e-6)]
    drift = torch.randn(20_000)
    for _ in range(200):
        grad = drift + 0.5 * torch.randn(20_000)
        ref.grad, sr.grad, nearest.grad = grad.clone(), grad.bfloat16(), grad.bfloat16()
        for optimizer in optimizers:
            optimizer.step()
    moved = float((ref.detach() - start).abs().mean())
    sr_moved = float((sr.detach().float() - start.bfloat16().float()).abs().mean())
    assert sr_moved == pytest.approx(moved, rel=0.05)
    assert (sr.detach().float() - ref.detach()).abs().mean() < 0.5 * moved
    assert (nearest.detach().float() - start.bfloat16().float()).abs().mean() < 0.1 * moved
    assert set(optimizers[1].state[sr]) == {"step", "exp_avg", "exp_avg_sq"}, "torch AdamW's keys: checkpoints alike"


def test_refused_where_it_cannot_work(monkeypatch) -> None:
    with pytest.raises(ValidationError, match="full_bf16 needs mixed_precision: bf16"):
        TrainConfig(full_bf16=True)
    with pytest.raises(ValidationError, match="lora trains small tensors kept in float32"):
        TrainConfig(full_bf16=True, mixed_precision="bf16", method="lora")
    with pytest.raises(ValidationError, match="use_ema cannot go with it"):
        TrainConfig(full_bf16=True, mixed_precision="bf16", use_ema=True)
    auto = TrainConfig(mixed_precision="bf16")
    assert auto.bf16_weights("cpu") == bool(cxx_compiler()) and not auto.bf16_weights("cuda")
    monkeypatch.setenv("CXX", "no-such-compiler")
    assert not auto.bf16_weights("cpu"), "auto: off without the compiler the fused update needs"
    monkeypatch.delenv("CXX")
    assert not TrainConfig(mixed_precision="bf16", method="lora").bf16_weights("cpu")
    assert not TrainConfig(mixed_precision="bf16", use_ema=True).bf16_weights("cpu"), "auto: off where it clashes"


@needs_compiler
def test_dreambooth_trains_bf16_weights_and_saves_float32(tmp_path, tiny_sd, instance_dir, class_dir, caplog,
                                                          monkeypatch) -> None:
    steps: list[int] = []
    real_step = StochasticAdamW.step
    monkeypatch.setattr(StochasticAdamW, "step", lambda self, *a: steps.append(1) or real_step(self, *a))
    config = TrainConfig(max_train_steps=3, train_batch_size=1, resolution=32, num_validation_images=0,
                         learning_rate=1e-3, mixed_precision="bf16", full_bf16=True, train_text_encoder=True,
                         checkpoints_dir=tmp_path / "ckpt")
    with caplog.at_level("INFO"):
        outcome = train(config, tiny_sd, instance_dir, class_dir, tmp_path / "out")
    assert "full_bf16: text_encoder, unet trained in bf16 with stochastic rounding" in caplog.text
    assert len(steps) == 3, "the stochastic-rounding AdamW made every update"
    assert len(outcome.history) == 3 and all(h.grad_norm > 0 for h in outcome.history)
    for name in (UNET, "text_encoder/model.safetensors"):
        saved, base = load_file(tmp_path / "out" / name), load_file(tiny_sd / name)
        assert all(t.dtype == torch.float32 for t in saved.values()), "the output in float32, as the base"
        assert any(not torch.equal(saved[k], base[k]) for k in saved), f"{name} trained"


@needs_compiler
def test_six_bf16_steps_equal_three_plus_resume_plus_three(tmp_path, tiny_sd, instance_dir) -> None:
    """The rounding bits depend on the step, the tensor and the element, not on a generator's
    stream: a run stopped after step 3 and resumed rounds as the uninterrupted one, bit for bit."""
    kw = dict(max_train_steps=6, train_batch_size=1, resolution=32, num_validation_images=0, learning_rate=1e-3,
              mixed_precision="bf16", full_bf16=True, with_prior_preservation=False, checkpointing_steps=100)
    straight = train(TrainConfig(**kw, checkpoints_dir=tmp_path / "a", resume="none"), tiny_sd, instance_dir, None,
                     tmp_path / "straight")

    class Stop(Exception):
        pass

    def stop_after_three(entry) -> None:
        if entry.step == 3:
            raise Stop

    interrupted = TrainConfig(**kw, checkpoints_dir=tmp_path / "b", resume="latest")
    with pytest.raises(Stop):
        train(interrupted, tiny_sd, instance_dir, None, tmp_path / "resumed", callbacks=[stop_after_three])
    resumed = train(interrupted, tiny_sd, instance_dir, None, tmp_path / "resumed")
    assert resumed.resumed_from == 3 and [h[1] for h in resumed.losses] == [h[1] for h in straight.losses]
    a, b = load_file(tmp_path / "straight" / UNET), load_file(tmp_path / "resumed" / UNET)
    assert all(torch.equal(a[k], b[k]) for k in a)
