"""The optimizers make_optimizer builds from the train section, on a small real module."""
from __future__ import annotations

import pytest
import torch

from tasks.train.config import TrainConfig
from tasks.train.optim import evaluating, make_optimizer, optimizer_name

pytestmark = pytest.mark.quick  # make test-fast


def _linear() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(8, 4)


def _step(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    module(torch.ones(2, 8)).square().sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("name, cls, settings", [
    ("prodigy", "Prodigy", dict(learning_rate=1.0, prodigy_beta3=0.9, prodigy_decouple=False)),
    ("adafactor", "Adafactor", dict(learning_rate=1e-2)),
    ("schedulefree_adamw", "AdamWScheduleFree", dict(learning_rate=1e-3)),
    ("lion", "Lion", dict(learning_rate=1e-4, adam_beta2=0.99)),
])
def test_each_optimizer_is_the_library_one_with_the_keys(name, cls, settings) -> None:
    module = _linear()
    cfg = TrainConfig(optimizer=name, **settings)
    optimizer = make_optimizer(cfg, [{"params": list(module.parameters())}], cfg.learning_rate)
    assert type(optimizer).__name__ == cls and optimizer_name(cfg, list(module.parameters())) == name
    group = optimizer.param_groups[0]
    assert group["lr"] == settings["learning_rate"]
    if name == "prodigy":
        assert group["beta3"] == 0.9 and group["decouple"] is False and group["use_bias_correction"] is True
    if name == "lion":
        assert group["betas"] == (0.9, 0.99)
    before = module.weight.detach().clone()
    with evaluating(optimizer):  # schedule-free steps only in train mode; the loop sets it (set_training)
        pass
    _step(module, optimizer)
    assert not torch.equal(before, module.weight), f"{name} stepped"


def test_schedule_free_validates_and_saves_its_average() -> None:
    """In train mode the weights are the point y gradients are taken at; `evaluating` swaps in the
    average x = y + (1 - 1/beta1)(z - y), and puts y back after."""
    module = _linear()
    cfg = TrainConfig(optimizer="schedulefree_adamw", learning_rate=1e-2)
    optimizer = make_optimizer(cfg, [{"params": list(module.parameters())}], cfg.learning_rate)
    with evaluating(optimizer):
        pass  # leaves it in train mode
    for _ in range(3):
        _step(module, optimizer)
    y = module.weight.detach().clone()
    z = optimizer.state[module.weight]["z"]
    with evaluating(optimizer):
        assert torch.allclose(module.weight, y.lerp(z, 1 - 1 / 0.9), atol=1e-7)
        assert not torch.allclose(module.weight, y)
    assert torch.allclose(module.weight, y, atol=1e-6), "training goes on from y"
