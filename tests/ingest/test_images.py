"""tasks.common.images: the grid and the conversions shared by the stages."""
from __future__ import annotations

import pytest
from PIL import Image

from tasks.common.images import (
    apply_exif_orientation,
    make_grid,
    resize_and_crop,
    resize_short_side,
    to_rgb,
)

pytestmark = pytest.mark.quick  # make test-fast


def test_grid_layout_and_mixed_sizes() -> None:
    ims = [Image.new("RGB", (32, 32), (i * 40, 0, 0)) for i in range(5)]
    ims.append(Image.new("RGBA", (16, 24), (0, 0, 255, 255)))
    grid = make_grid(ims)  # 6 images -> 3 columns, 2 rows
    assert grid.size == (96, 64) and grid.mode == "RGB"
    assert grid.getpixel((32 + 16, 0 + 16)) == (40, 0, 0)
    assert grid.getpixel((64 + 16, 32 + 16)) == (0, 0, 255)  # small image centred in its cell
    assert grid.getpixel((64 + 2, 32 + 2)) == (255, 255, 255)
    assert make_grid(ims, cols=6).size == (192, 32)
    assert make_grid(ims[:1], cols=4).size == (32, 32)
    with pytest.raises(ValueError):
        make_grid([])


def test_resize_and_crop_keeps_short_side() -> None:
    out = resize_and_crop(Image.new("RGB", (300, 100)), 50)
    assert out.size == (50, 50)
    assert resize_and_crop(Image.new("RGB", (10, 40)), 20, center=False).size == (20, 20)


def test_to_rgb_float_and_32bit() -> None:
    f = Image.new("F", (4, 4), 0.0)
    f.putpixel((0, 0), 10.0)
    rgb = to_rgb(f)
    assert rgb.getpixel((0, 0)) == (255, 255, 255) and rgb.getpixel((1, 1)) == (0, 0, 0)
    assert to_rgb(Image.new("I", (4, 4), 200)).getpixel((0, 0)) == (200, 200, 200)


def test_resize_short_side_keeps_the_aspect_ratio() -> None:
    assert resize_short_side(Image.new("RGB", (300, 100)), 50).size == (150, 50)
    same = Image.new("RGB", (80, 50))
    assert resize_short_side(same, 50) is same


def test_exif_orientation_upright_is_not_copied_and_rotated_is_turned() -> None:
    upright = Image.new("RGB", (40, 20))
    assert apply_exif_orientation(upright) is upright
    turned = Image.new("RGB", (40, 20))
    turned.getexif()[0x0112] = 6  # stored sideways: 90 degrees clockwise to view
    assert apply_exif_orientation(turned).size == (20, 40)
