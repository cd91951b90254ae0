"""tasks/common/psnr.py: known values, the cap, and non-finite images scoring the floor."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from tasks.common.psnr import NON_FINITE_DB, PSNR_CAP_DB, psnr_db

pytestmark = pytest.mark.quick  # make test-fast


def test_known_values_for_float_images() -> None:
    a = np.zeros((4, 4, 3))
    assert psnr_db(a, a + 0.1) == pytest.approx(20.0)  # MSE 0.01 -> 20 dB
    assert psnr_db(a, np.ones_like(a)) == pytest.approx(0.0)  # as far apart as [0, 1] allows


def test_known_values_for_8_bit_images() -> None:
    black = Image.new("RGB", (8, 8))
    one = Image.new("RGB", (8, 8), (1, 1, 1))
    assert psnr_db(black, one, peak=255.0) == pytest.approx(20 * np.log10(255.0))  # MSE 1: 48.13 dB
    assert psnr_db(black, Image.new("RGB", (8, 8), (255, 255, 255)), peak=255.0) == pytest.approx(0.0)
    # uint8 arrays are read as values, not wrapped around: 0 - 1 is -1, not 255
    assert psnr_db(np.zeros(4, np.uint8), np.ones(4, np.uint8), peak=255.0) == pytest.approx(48.1308, abs=1e-4)


def test_identical_and_nearly_identical_images_are_capped() -> None:
    a = np.linspace(0, 1, 48).reshape(4, 4, 3)
    assert psnr_db(a, a) == PSNR_CAP_DB  # +inf, recorded at the cap (JSON has no infinity)
    assert psnr_db(a, a + 1e-9) == PSNR_CAP_DB  # 180 dB, above the cap


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_image_scores_the_floor_and_never_passes_a_threshold(bad: float) -> None:
    a = np.full((4, 4, 3), 0.5)
    broken = a.copy()
    broken[0, 0, 0] = bad  # one bad value is enough
    for x, y in ((a, broken), (broken, a), (broken, broken)):  # NaN against NaN is not "identical"
        value = psnr_db(x, y)
        assert value == NON_FINITE_DB and np.isfinite(value)  # JSON-safe
        assert not value >= 30.0  # the export's default parity threshold
    assert psnr_db(np.full_like(a, np.nan), np.full_like(a, np.nan)) == NON_FINITE_DB


def test_overflowing_finite_values_score_the_floor() -> None:
    a = np.zeros(4)
    assert psnr_db(a, np.full(4, 1e200)) == NON_FINITE_DB  # squared difference overflows to inf


def test_images_of_different_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="one shape"):
        psnr_db(np.zeros((8, 8, 3)), np.zeros((4, 4, 3)))
    with pytest.raises(ValueError, match="one shape"):
        psnr_db(Image.new("RGB", (8, 8)), Image.new("RGB", (4, 4)), peak=255.0)
