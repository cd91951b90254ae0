"""The served model's door: every request setting typed and bounded, refused with the field's name
and the allowed range before any image is generated (the bad-input table runs without a model)."""
from __future__ import annotations

import pandas as pd
import pytest
from mlflow.exceptions import MlflowException

from tasks.register.serving_limits import MAX_IMAGES, SETTINGS, check_request, signature

pytestmark = pytest.mark.quick  # make test-fast

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
                        "width": None, "num_images_per_prompt": 1, "adapter": ""}
    assert check_request(["a"] * 4, {"num_images_per_prompt": 4, "guidance_scale": 0})[1]["guidance_scale"] == 0.0
    assert len(check_request(["a"] * 8, {"num_images_per_prompt": 2})[0]) * 2 == MAX_IMAGES
    assert check_request(["a"], {"height": 66}, size_multiple=2)[1]["height"] == 66, "the model's VAE factor rules"


def test_the_signature_declares_every_setting_with_its_type_and_default() -> None:
    params = {p.name: (p.dtype.name, p.default) for p in signature().params.params}
    assert params == {**{name: (s.type, s.default) for name, s in SETTINGS.items()}, "adapter": ("string", "")}
    assert signature().inputs.input_types()[0].name == "string"
