"""The served model's door: every request setting typed and bounded, refused with the field's name
and the allowed range before any image is generated (the bad-input table runs without a model)."""
from __future__ import annotations

import base64
import io
import json

import pandas as pd
import pytest
from mlflow.exceptions import MlflowException
from PIL import Image

from finetune_runtime import images as input_images_mod
from finetune_runtime import limits
from finetune_runtime.convention import CallConvention
from finetune_runtime.limits import MAX_IMAGES, SETTINGS, Budget, signature
from finetune_runtime.size import Shape

pytestmark = pytest.mark.quick  # make test-fast


def check_request(inputs, params, *, size_multiple: int = 8, input_images: int = 0,
                  size: tuple[int, int] | None = None, budget: Budget | None = None,
                  default: tuple[int, int] = (512, 512)) -> tuple[list[str], dict]:
    """limits.check_request for a pipeline that makes `default` (or only `size`, a static export), its
    sides multiples of `size_multiple`, taking `input_images` as FLUX.2 [klein] does (latents in 2x2
    patches, an input image encoded at most a megapixel)."""
    shape = Shape(size, True, size_multiple) if size else Shape(default, False, size_multiple)
    convention = CallConvention(input_images=input_images, latent_patch=2, edit_pixels=1024 * 1024)
    return limits.check_request(inputs, params, shape, convention, budget)

BAD = [
    # (inputs, params, what the error must say)
    (42, {}, r"inputs: expected a list of prompt strings, got int"),
    ([42], {}, r"inputs\[0\]: 42 is not a prompt; allowed: a non-empty string"),
    (["a", None], {}, r"inputs\[1\]: None is not a prompt"),
    ([""], {}, r"inputs\[0\]: '' is not a prompt"),
    (["   "], {}, r"inputs\[0\]: '   ' is not a prompt"),
    ([], {}, r"inputs: 0 prompts; allowed: 1 to 8 per request"),
    (["a"] * 9, {}, r"inputs: 9 prompts; allowed: 1 to 8"),
    (["x" * 1001], {}, r"inputs\[0\]: 1001 characters; allowed: at most 1000"),
    (pd.DataFrame({"a": ["x"], "b": ["y"]}), {}, r"expected a 'prompt' column, got columns \['a', 'b'\]"),
    (["a"], {"num_inference_steps": -3}, r"num_inference_steps: -3 is out of range; allowed: an integer from 1 to 100"),
    (["a"], {"num_inference_steps": 0}, r"num_inference_steps: 0 is out of range"),
    (["a"], {"num_inference_steps": 10_000}, r"num_inference_steps: 10000 is out of range"),
    (["a"], {"num_inference_steps": 2.5}, r"num_inference_steps: 2.5 is not an integer from 1 to 100"),
    (["a"], {"num_inference_steps": True}, r"num_inference_steps: True is not an integer"),
    (["a"], {"num_inference_steps": "5"}, r"num_inference_steps: '5' is not an integer"),
    (["a"], {"seed": -1}, r"seed: -1 is out of range; allowed: an integer from 0 to 4294967295"),
    (["a"], {"guidance_scale": -1.0}, r"guidance_scale: -1.0 is out of range; allowed: a number from 0 to 30"),
    (["a"], {"guidance_scale": float("nan")}, r"guidance_scale: nan is not a number from 0 to 30"),
    (["a"], {"guidance_scale": float("inf")}, r"guidance_scale: inf is not a number"),
    (["a"], {"height": 65}, r"height: 65 is not a multiple of 8, which this model needs"),
    (["a"], {"width": 4096}, r"width: 4096 is out of range; allowed: an integer from 64 to 1024"),
    (["a"], {"height": 32}, r"height: 32 is out of range"),
    (["a"], {"num_images_per_prompt": 5}, r"num_images_per_prompt: 5 is out of range; allowed: an integer from 1 to 4"),
    (["a"] * 5, {"num_images_per_prompt": 4}, r"5 prompts x num_images_per_prompt 4 = 20 images; at most 16"),
    (["a"], {"steps": 3}, r"unknown params \['steps'\]; allowed: \['adapter', 'guidance_scale', 'height'"),
    (["a"], {"adapter": 3}, r"adapter: 3 is not a text of at most 1000 characters"),
]


@pytest.mark.parametrize(("inputs", "params", "error"), BAD, ids=[e[2][:40] for e in BAD])
def test_bad_requests_are_refused_with_the_field_and_range(inputs, params, error) -> None:
    with pytest.raises(MlflowException, match=error) as info:
        check_request(inputs, params)
    assert info.value.error_code == "INVALID_PARAMETER_VALUE"  # HTTP 400 from mlflow models serve


def test_defaults_fill_in_and_good_values_pass() -> None:
    prompts, settings = check_request(pd.DataFrame({"prompt": ["a", "b"]}), {"seed": 4, "height": 128})
    assert prompts == ["a", "b"]
    assert settings == {"seed": 4, "num_inference_steps": 20, "guidance_scale": 7.5, "height": 128,
                        "width": 512, "num_images_per_prompt": 1, "adapter": "", "image": []}  # the model's width
    assert check_request(["a"] * 4, {"num_images_per_prompt": 4, "guidance_scale": 0})[1]["guidance_scale"] == 0.0
    assert len(check_request(["a"] * 8, {"num_images_per_prompt": 2})[0]) * 2 == MAX_IMAGES
    assert check_request(["a"], {"height": 66}, size_multiple=2)[1]["height"] == 66, "the model's VAE factor rules"


def test_the_signature_declares_every_setting_with_its_type_and_default() -> None:
    params = {p.name: (p.dtype.name, p.default) for p in signature().params.params}
    assert params == {**{name: (s.type, s.default) for name, s in SETTINGS.items()}, "adapter": ("string", ""),
                      "image": ("string", "")}  # one string, not a list param (images.py)
    assert signature().inputs.input_types()[0].name == "string"


def _b64(image: Image.Image, fmt: str = "PNG", **save: object) -> str:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **save)
    return base64.b64encode(buf.getvalue()).decode("ascii")


RED = Image.new("RGB", (96, 80), (200, 30, 30))
BAD_IMAGES = [
    # (image param, a JSON list unless a string, input images the model takes, what the error must say)
    ([_b64(RED)], 0, r"image: this model takes no input image .*send the prompts alone"),
    (_b64(RED), 0, r"image: this model takes no input image .*send the prompts alone"),
    ([_b64(RED)] * 5, 4, r"image: 5 input images; this model takes at most 4"),
    ("[" + _b64(RED), 4, r"image: starts with '\[' but is not a JSON list .*send one base64 image, or json.dumps"),
    ('{"a": 1}', 4, r"image\[0\]: not base64"),  # not a list: one (bad) file
    ("[" + " " * (4 * (16 * 2**20 + 16)), 4, r"image: 67108929 characters; allowed: at most 4 images of"),
    ([7], 4, r"image\[0\]: expected a base64-encoded PNG, JPEG or WebP file, got int"),
    ([_b64(RED), "not base64!"], 4, r"image\[1\]: not base64"),
    ([base64.b64encode(b"hello, world").decode()], 4, r"^image\[0\]: not an image \(a PNG, JPEG or WebP file, "
                                                      r"base64-encoded\)$"),
    ([_b64(RED, "GIF")], 4, r"image\[0\]: a GIF file; allowed: PNG, JPEG, WEBP"),
    ([_b64(Image.new("RGB", (32, 80)))], 4, r"image\[0\]: 32x80 px; allowed: each side from 64 to 4096"),
    ([_b64(Image.new("L", (5000, 64)))], 4, r"image\[0\]: 5000x64 px; allowed"),
    (["A" * (16 * 2**20 + 4)], 4, r"image\[0\]: 16777220 base64 characters; allowed: at most"),
    ([_b64(Image.new("RGB", (4096, 64)))], 4, r"image\[0\]: 4096x64 px would make an edit of height 16 px; pass "
                                               r"height \(at least 64\)"),
]


@pytest.mark.parametrize(("value", "allowed", "error"), BAD_IMAGES, ids=[e[2][:40] for e in BAD_IMAGES])
def test_bad_input_images_are_refused_naming_the_image(value, allowed, error) -> None:
    with pytest.raises(MlflowException, match=error) as info:
        check_request(["make it blue"], {"image": value if isinstance(value, str) else json.dumps(value)},
                      input_images=allowed)
    assert info.value.error_code == "INVALID_PARAMETER_VALUE"  # HTTP 400 from mlflow models serve


def test_a_list_param_is_refused_naming_the_shape() -> None:
    """MLflow refuses a list for the string param before the model; predict() called directly says what to send."""
    with pytest.raises(MlflowException, match=r"^image: expected one string, a base64-encoded image or a JSON list"):
        check_request(["make it blue"], {"image": [_b64(RED)]}, input_images=4)


def test_pixels_are_decoded_only_when_asked_and_a_damaged_file_is_named_then() -> None:
    """check_request reads headers only (the request's turn decodes): a truncated PNG passes it and
    images.decoded names it."""
    png = base64.b64decode(_b64(RED))
    truncated = base64.b64encode(png[: len(png) // 2]).decode()
    _, settings = check_request(["a"], {"image": json.dumps([_b64(RED), truncated])}, input_images=4)
    assert [im.size for im in settings["image"]] == [(96, 80), (96, 80)]
    with pytest.raises(MlflowException, match=r"^image\[1\]: the file is damaged"):
        input_images_mod.decoded(settings["image"])


def test_input_images_are_decoded_upright_and_set_the_edit_size() -> None:
    rotated = Image.new("RGB", (80, 96), (0, 0, 255))
    exif = rotated.getexif()
    exif[0x0112] = 6  # stored 80x96, shown turned: 96x80
    images = [_b64(RED), "data:image/jpeg;base64," + _b64(rotated, "JPEG", exif=exif), _b64(RED, "WEBP")]
    _, settings = check_request(["make it blue"], {"image": json.dumps(images)}, size_multiple=8, input_images=4)
    assert [im.size for im in settings["image"]] == [(96, 80), (96, 80), (96, 80)], "upright from the header"
    pixels = input_images_mod.decoded(settings["image"])
    assert [im.size for im in pixels] == [(96, 80), (96, 80), (96, 80)] and {im.mode for im in pixels} == {"RGB"}
    assert (settings["height"], settings["width"]) == (80, 96), "the first image's size, a multiple of 16"
    big = Image.new("RGB", (2000, 1500))
    _, settings = check_request(["a"], {"image": _b64(big)}, size_multiple=8, input_images=1)
    assert (settings["height"], settings["width"]) == (752, 1024), "at most 1024 px a side and a megapixel"
    _, asked = check_request(["a"], {"image": _b64(big), "height": 256, "width": 512}, input_images=1)
    assert (asked["height"], asked["width"]) == (256, 512), "a size asked for wins"
    wide = _b64(Image.new("RGB", (4096, 64)))  # alone it would make a 16 px high edit: refused, naming height
    _, one_side = check_request(["a"], {"image": wide, "height": 512}, input_images=1)
    assert (one_side["height"], one_side["width"]) == (512, 1024), "the side not asked is the image's"
    _, static = check_request(["a"], {"image": _b64(big)}, input_images=1, size=(64, 64))
    assert (static["height"], static["width"]) == (64, 64), "a static export makes its own size"
    assert check_request(["a"], {}, input_images=4)[1]["image"] == []


def test_an_edit_models_budget_counts_edits_with_their_input_images() -> None:
    """FLUX.2 [klein]'s default budget at the tiny model's 64 px: 4 edits, each with the 4 input images a
    call takes at that size; the README's request (the demo's 128 px reference, every other setting
    its default: an edit at 128 px) fits it."""
    budget = Budget(4, 64, 64, input_images=4)
    assert budget.pixel_steps == 4 * 20 * 64 * 64 * 5 and Budget(4, 64, 64).pixel_steps == 4 * 20 * 64 * 64
    reference = _b64(Image.new("RGB", (128, 128)))
    _, settings = check_request(["turn it blue"], {"image": reference}, budget=budget, input_images=4,
                                default=(64, 64))
    assert (settings["height"], settings["width"]) == (128, 128)
    with pytest.raises(MlflowException) as info:  # 3 x 20 x (128x128 + 128x128) = 4.8 default edits
        check_request(["turn it blue"], {"image": reference, "num_images_per_prompt": 3}, budget=budget,
                      input_images=4, default=(64, 64))
    assert "= 1966080 pixel-steps (4.8 default edits) is over this model's budget of 1638400 (4 edits of 64x64 px " \
           "at 20 steps, each with 4 input images of that size; model_config budget_images)" in info.value.message


def test_input_images_count_towards_the_cost() -> None:
    budget = Budget(1.0, 96, 96, steps=20)
    check_request(["a"], {"num_inference_steps": 10, "height": 96, "width": 96}, budget=budget)
    image = _b64(Image.new("RGB", (96, 96)))
    check_request(["a"], {"num_inference_steps": 10, "height": 96, "width": 96, "image": image},
                  budget=budget, input_images=4)  # 10 x (96x96 + 96x96) = the budget
    with pytest.raises(MlflowException, match=r"x \(height 96 x width 96 \+ image 18432 px\) = 276480 pixel-steps"):
        check_request(["a"], {"num_inference_steps": 10, "height": 96, "width": 96, "image": json.dumps([image] * 2)},
                      budget=budget, input_images=4)


def test_an_edit_only_model_needs_an_input_image_and_pays_its_megapixel() -> None:
    """Qwen-Image-Edit's convention: a prompt alone is refused naming `image`; every input image costs
    the megapixel its pipeline encodes it at, whatever its size, and the budget holds edits with them."""
    convention = CallConvention(input_images=4, latent_patch=2, min_input_images=1, input_pixels=1024 * 1024)
    shape = Shape((64, 64), False, 8)
    budget = Budget(4, 64, 64, input_images=4, input_pixels=1024 * 1024)
    assert budget.pixel_steps == 4 * 20 * (64 * 64 + 4 * 1024 * 1024)
    with pytest.raises(MlflowException, match=r"^image: this model edits an input image and cannot make one from a "
                                              r"prompt alone; send 1 or more \(up to 4\)") as info:
        limits.check_request(["make it blue"], {}, shape, convention, budget)
    assert info.value.error_code == "INVALID_PARAMETER_VALUE"
    small = _b64(Image.new("RGB", (64, 64)))
    _, settings = limits.check_request(["make it blue"], {"image": small}, shape, convention, budget)
    assert (settings["height"], settings["width"]) == (64, 64), "made at the input image's size"
    with pytest.raises(MlflowException, match=r"x \(height 64 x width 64 \+ image 4194304 px\) = .* over this model's "
                                              r"budget of .* \(4 edits of 64x64 px at 20 steps, each with 4 input "
                                              r"images of 1 megapixel;"):
        limits.check_request(["a"] * 4, {"image": json.dumps([small] * 4), "num_images_per_prompt": 2}, shape,
                             convention, budget)


def test_mlflow_checks_the_image_param_within_a_small_multiple_of_its_size() -> None:
    """What MLflow does with `image` before the model (the params check PyFuncModel.predict and `mlflow models
    serve` run): the issue's 4 MB request, a list for the string param, is refused (HTTP 400) having
    allocated a few copies of it, not count x longest x 4 bytes (1.2 GB as a list param's array)."""
    import tracemalloc

    from mlflow.models.utils import _enforce_params_schema

    request = {"image": ["A" * 4_000_000] + ["x"] * 300}
    tracemalloc.start()
    try:
        with pytest.raises(MlflowException, match="image") as info:
            _enforce_params_schema(request, signature().params)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert info.value.error_code == "INVALID_PARAMETER_VALUE"
    assert peak < 10 * 4_000_000, f"{peak / 1e6:.0f} MB to refuse a 4 MB param"
    one = json.dumps(["A" * 4_000_000])  # the same bytes as one string: accepted as is, then checked by the model
    assert _enforce_params_schema({"image": one}, signature().params)["image"] == one
