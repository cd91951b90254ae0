"""A served model cannot be tied up: the cost budget, the bounded wait for the model and the
deadline that stops a generation, on a stand-in pipeline (no model, seconds in all). The same
limits against the real `mlflow models serve`: tests/register/test_model_serving.py."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
from mlflow.exceptions import MlflowException
from PIL import Image

from finetune_runtime.convention import CallConvention
from finetune_runtime.limits import SERVING_DEFAULTS, TIMEOUT_ENV, Budget, Turns, serving_config
from finetune_runtime.load import Loaded
from finetune_runtime.model import DiffusionImageModel
from finetune_runtime.size import shape_of
from tests.runtime.test_request_inputs import check_request

pytestmark = pytest.mark.quick  # make test-fast


def test_a_request_over_budget_is_refused_naming_the_fields_and_the_budget() -> None:
    budget = Budget(4, 512, 512)  # 4 images of 512 px at 20 steps
    assert budget.pixel_steps == 4 * 20 * 512 * 512
    with pytest.raises(MlflowException) as info:
        check_request(["a"] * 4, {"num_images_per_prompt": 4, "num_inference_steps": 100, "height": 1024,
                                  "width": 1024}, budget=budget)
    message = info.value.message
    assert info.value.get_http_status_code() == 400
    for part in ("4 prompts x num_images_per_prompt 4 x num_inference_steps 100 x height 1024 x width 1024",
                 "= 1677721600 pixel-steps (320 default images)", "budget of 20971520",
                 "4 images of 512x512 px at 20 steps; model_config budget_images"):
        assert part in message, message


def test_the_budget_counts_the_default_size_and_a_static_shape() -> None:
    budget = Budget(4, 512, 512)
    assert check_request(["a"] * 4, {}, budget=budget)[1]["height"] == 512  # 4 default images: at budget
    with pytest.raises(MlflowException, match="5 prompts x num_images_per_prompt 1 x num_inference_steps 20 "
                                              "x height 512 x width 512"):
        check_request(["a"] * 5, {}, budget=budget)
    check_request(["a"] * 8, {"height": 256, "width": 512}, budget=budget)  # half the pixels: 8 fit
    check_request(["a"], {"num_inference_steps": 80}, budget=budget)  # 4x the steps: one fits
    with pytest.raises(MlflowException, match="x height 64 x width 64 = "):  # the shape it makes counts
        check_request(["a"] * 8, {"height": 1024, "width": 1024, "num_inference_steps": 100},
                      budget=Budget(4, 64, 64), size=(64, 64))


def test_serving_config_fills_in_and_refuses_bad_values() -> None:
    assert serving_config(None) == SERVING_DEFAULTS
    assert serving_config({"budget_images": 2, "other": 1}) == {**SERVING_DEFAULTS, "budget_images": 2.0}
    for bad in ({"budget_images": 0}, {"budget_images": "4"}, {"budget_images": float("inf")},
                {"max_waiting": -1}, {"max_waiting": 1.5}, {"max_waiting": True}, {"adapter_cache_mb": 0},
                {"adapter_cache_mb": "1"}):
        with pytest.raises(ValueError, match=f"model_config {next(iter(bad))}"):
            serving_config(bad)


def test_the_default_size_is_the_models_own() -> None:
    parts = {"vae": SimpleNamespace(config={"sample_size": 512}),  # pixels: not the one that counts
             "denoiser": SimpleNamespace(config={"sample_size": 64})}
    none = CallConvention()

    def default(pipe, convention=none, exported=None):
        shape = shape_of(pipe, convention, exported)
        return shape.default, shape.static

    assert default(SimpleNamespace(components=parts, vae_scale_factor=8)) == ((512, 512), False)  # SD 1.x
    assert default(SimpleNamespace(default_sample_size=128, vae_scale_factor=8)) == ((1024, 1024), False)
    assert default(SimpleNamespace(height=64, width=96, components=parts)) == ((64, 96), True)  # static export
    assert default(SimpleNamespace(height=-1, width=-1, components=parts, vae_scale_factor=2)) == ((128, 128), False)
    assert default(SimpleNamespace(height=-1, width=-1, components=parts), none, (32, 48)) == ((32, 48), False)
    assert default(SimpleNamespace(vae_scale_factor=2), CallConvention(default_sample_size=128)) == ((256, 256), False)
    assert default(SimpleNamespace()) == ((512, 512), False)


def _in_thread(fn) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except Exception as err:  # the test reads it
            out["error"] = err
    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def test_at_most_max_waiting_requests_wait_and_the_next_is_told_to_retry() -> None:
    turns, release = Turns(max_waiting=1), threading.Event()

    def hold() -> None:
        with turns.turn(None):
            release.wait(10)
    first, _ = _in_thread(hold)
    while not turns.model.locked():
        time.sleep(0.01)
    got_it = threading.Event()

    def wait_then_hold() -> None:
        with turns.turn(None):
            got_it.set()
    second, second_out = _in_thread(wait_then_hold)  # waits for the model
    while turns.waiting < 1:
        time.sleep(0.01)
    with pytest.raises(MlflowException, match=r"busy: one request generating and 1 waiting.*max_waiting 1"
                                              r"\); retry after about \d+ s") as info, turns.turn(None):
        pass
    assert info.value.get_http_status_code() == 429 and info.value.json_kwargs["retry_after_s"] >= 1
    release.set()
    first.join(5)
    second.join(5)
    assert "error" not in second_out and got_it.is_set(), "the waiting one had its turn"
    assert not turns.model.locked() and turns.waiting == 0


def test_a_waiting_request_gives_up_at_its_deadline() -> None:
    turns = Turns(max_waiting=2)
    turns.model.acquire()
    start = time.monotonic()
    with pytest.raises(MlflowException, match="waited 0.2 s for the model") as info, turns.turn(time.monotonic() + 0.2):
        pass
    assert info.value.get_http_status_code() == 504 and 0.15 < time.monotonic() - start < 5
    assert turns.waiting == 0


class SlowPipe:
    """A stand-in pipeline: `step_s` per denoising step, calling `callback_on_step_end` like diffusers."""

    vae_scale_factor, height, width = 8, -1, -1

    def __init__(self, step_s: float) -> None:
        self.step_s, self.steps = step_s, 0
        self.components = {"denoiser": SimpleNamespace(config={"sample_size": 8})}  # 64 px

    def set_progress_bar_config(self, **_) -> None:
        pass

    def __call__(self, prompt, num_inference_steps, callback_on_step_end=None, **_):
        for i in range(num_inference_steps):
            time.sleep(self.step_s)
            self.steps += 1
            if callback_on_step_end is not None:
                callback_on_step_end(self, i, i, {})
        return SimpleNamespace(images=[Image.new("RGB", (8, 8))])


def test_a_generation_stops_at_the_servers_timeout_and_frees_the_model(monkeypatch) -> None:
    import torch  # noqa: F401 (imported by the first generation otherwise, inside the timed request)

    monkeypatch.setenv(TIMEOUT_ENV, "0.5")
    model, pipe = DiffusionImageModel(), SlowPipe(0.02)
    model.serve(Loaded(pipe, "stand-in", "stand-in"), {"budget_images": 100})
    start = time.monotonic()
    with pytest.raises(MlflowException, match=rf"stopped after 0.5 s \({TIMEOUT_ENV}\), at image 1 of 1, "
                                              r"step \d+") as info:
        model.predict(None, ["a"], {"num_inference_steps": 100})
    assert info.value.get_http_status_code() == 504
    assert time.monotonic() - start < 3 and pipe.steps < 100, "it stopped, the 100 steps did not run"
    assert not model.turns.model.locked(), "the model is free again"
    assert len(model.predict(None, ["a", "b"], {"num_inference_steps": 2})) == 2


def test_no_deadline_outside_the_server_and_over_budget_touches_nothing(monkeypatch) -> None:
    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    model, pipe = DiffusionImageModel(), SlowPipe(0.0)
    model.serve(Loaded(pipe, "stand-in", "stand-in"), None)
    assert model.timeout_s is None and model.budget == Budget(4.0, 64, 64)
    assert len(model.predict(None, ["a"], {"num_inference_steps": 80})) == 1
    with pytest.raises(MlflowException, match="over this model's budget"):
        model.predict(None, ["a"], {"num_inference_steps": 81})
    assert pipe.steps == 80


def test_an_edit_models_budget_counts_the_input_images_its_call_takes() -> None:
    model = DiffusionImageModel()
    model.serve(Loaded(SlowPipe(0.0), "stand-in", "stand-in"), {"pipeline_call": {"input_images": 4}})
    assert model.budget == Budget(4.0, 64, 64, input_images=4)


def test_the_register_params_defaults_are_the_models() -> None:
    from tasks.register.config import RegisterConfig

    cfg = RegisterConfig(model_name="m")
    assert {"budget_images": cfg.serve_budget_images, "max_waiting": cfg.serve_max_waiting,
            "adapter_cache_mb": cfg.serve_adapter_cache_mb} == SERVING_DEFAULTS
