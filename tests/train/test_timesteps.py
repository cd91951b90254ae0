"""Flow-matching timestep sampling (`timestep_sampling`, `timestep_shift`) on the schedulers the tiny
SD3 and FLUX.1 builders give their pipelines: with a fixed seed, the sampled sigmas move as the
density and the shift say."""
from __future__ import annotations

import math

import pytest
import torch

from tasks.common.errors import UserError
from tasks.common.families.flow import flow_scheduler
from tasks.train.config import TrainConfig
from tasks.train.objectives import FlowMatching

pytestmark = pytest.mark.quick  # make test-fast

N = 20000
SD3 = flow_scheduler(shift=3.0)  # builtin:tiny-sd3's (SD3's shift 3.0)
FLUX = flow_scheduler(shift=3.0, dynamic=True)  # builtin:tiny-flux's: shifted at inference only


def sigmas(scheduler, latent_hw=(32, 32), scheme="none", **settings) -> torch.Tensor:
    torch.manual_seed(0)
    objective = FlowMatching(scheduler, TrainConfig(**settings), {"weighting_scheme": scheme})
    return objective.sigmas(objective._u(N, None), latent_hw)[1]


def shifted(sigma: float, shift: float) -> float:
    return shift * sigma / (1 + (shift - 1) * sigma)


def test_a_fixed_shift_moves_the_median_as_it_says() -> None:
    assert sigmas(FLUX).median() == pytest.approx(0.5, abs=0.01), "FLUX's scheduler trains unshifted"
    assert sigmas(SD3).median() == pytest.approx(shifted(0.5, 3.0), abs=0.01), "null: the base's shift 3.0"
    for shift in (0.5, 1.0, 3.0, 6.0):
        drawn = sigmas(FLUX, timestep_shift=shift)
        assert drawn.median() == pytest.approx(shifted(0.5, shift), abs=0.01), shift
        assert drawn.quantile(0.9) == pytest.approx(shifted(0.9, shift), abs=0.01), shift
    assert torch.equal(sigmas(SD3, timestep_shift=3.0), sigmas(FLUX, timestep_shift=3.0)), "the base's shift left"


def test_auto_shifts_larger_images_to_more_noise_as_flux_does() -> None:
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    medians = {}
    for side in (32, 64, 128):  # latent sides: 256, 1024, 4096 tokens of 2x2 patches
        drawn = sigmas(FLUX, latent_hw=(side, side), timestep_shift="auto")
        mu = calculate_shift((side // 2) ** 2, 256, 4096, 0.5, 1.15)
        assert drawn.median() == pytest.approx(shifted(0.5, math.exp(mu)), abs=0.01), side
        medians[side] = float(drawn.median())
    assert medians[32] < medians[64] < medians[128]
    assert medians[32] == pytest.approx(shifted(0.5, math.exp(0.5)), abs=0.01), "256 tokens: base_shift 0.5"


def test_the_densities_peers_name() -> None:
    uniform = sigmas(SD3, scheme="logit_normal", timestep_sampling="uniform", timestep_shift=1.0)
    assert uniform.quantile(0.25) == pytest.approx(0.25, abs=0.01), "uniform replaces SD3's logit_normal"
    narrow = sigmas(FLUX, timestep_sampling="sigmoid", timestep_shift=1.0)
    wide = sigmas(FLUX, timestep_sampling="sigmoid", sigmoid_scale=2.0, timestep_shift=1.0)
    assert narrow.median() == pytest.approx(0.5, abs=0.01) and wide.median() == pytest.approx(0.5, abs=0.01)
    spread = {name: float(s.quantile(0.75) - s.quantile(0.25)) for name, s in (("narrow", narrow), ("wide", wide))}
    assert spread["narrow"] == pytest.approx(2 * (1 / (1 + math.exp(-0.6745)) - 0.5), abs=0.01), spread
    assert spread["wide"] > spread["narrow"] + 0.1, spread
    late = sigmas(FLUX, timestep_sampling="logit_normal", logit_mean=1.0, timestep_shift=1.0)
    assert late.median() == pytest.approx(1 - 1 / (1 + math.exp(-1.0)), abs=0.01), "u = sigmoid(N(1, 1)), sigma 1-u"


@pytest.mark.parametrize("setting, says", [
    (dict(timestep_shift=0.0), "timestep_shift must be above 0"),
    (dict(timestep_shift="high"), r"train\.timestep_shift"),
    (dict(timestep_sampling="sigmoid", weighting_scheme="logit_normal"), "both choose the timestep density"),
    (dict(timestep_sampling="gaussian"), r"train\.timestep_sampling"),
])
def test_bad_timestep_settings_are_refused_at_load(setting, says) -> None:
    from tasks.common.config import parse_section

    with pytest.raises(UserError, match=says):
        parse_section("train", setting, TrainConfig)
