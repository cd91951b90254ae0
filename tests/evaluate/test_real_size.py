"""Evaluate at real size, on the tiny models: one pipeline in memory at a time, the encoders after
the last, each phase's peak RSS, and the base's images cached across fine-tunes of one base."""
from __future__ import annotations

import json
import os
import weakref

import pytest

from tasks.evaluate.config import EvaluateConfig
from tasks.evaluate.protocol import images_hash
from tests.export.tiny_ov import exported, tiny_pipeline, write_subject_images

SHAPE = {"batch_size": 2, "height": 64, "width": 64, "num_images_per_prompt": 1}
BALLAST_MB = 300  # held by each pipeline and by the encoders in the memory run: far above the tiny models


def _config(**extra) -> EvaluateConfig:
    fields = dict(prompts=["a {identifier} {class_name}", "a red {class_name}"], images_per_prompt=1,
                  num_inference_steps=2, drift={"images_per_prompt": 1})
    return EvaluateConfig(**{**fields, **extra})


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The tiny SD base and two 'fine-tunes' of it (full pipelines drawn from other seeds)."""
    from tasks.common.families import build_tiny_pipeline

    root = tmp_path_factory.mktemp("real-size")
    tunes = [build_tiny_pipeline("builtin:tiny-sd", seed, root / f"tune-{seed}") for seed in (1, 2)]
    return {"base": tiny_pipeline(tmp_path_factory, "builtin:tiny-sd"), "tunes": tunes,
            "data": write_subject_images(root / "data"), "cache": root / "cache"}


@pytest.fixture(scope="module")
def cached(models):
    """Fine-tune 1 (a miss: the base generates and is cached), fine-tune 2 with the base loader
    broken (a hit), then fine-tune 2 again under another seed (a miss)."""
    from tasks.evaluate import core, phases

    def refuse(path):
        raise AssertionError("the base pipeline was loaded on a cache hit")

    cfg = _config(base_cache_dir=str(models["cache"]))
    first = core.evaluate(models["tunes"][0], models["base"], models["data"], cfg)
    mp = pytest.MonkeyPatch()
    mp.setattr(phases, "load_base", refuse)
    try:
        second = core.evaluate(models["tunes"][1], models["base"], models["data"], cfg)
    finally:
        mp.undo()
    other = core.evaluate(models["tunes"][1], models["base"], models["data"], _config(
        base_cache_dir=str(models["cache"]), seed=1))
    return first, second, other


def test_a_second_fine_tune_of_the_same_base_reads_its_images_from_the_cache(cached, models):
    first, second, _ = cached
    assert first.report["generation"]["base_cache"] == "miss"
    assert second.report["generation"]["base_cache"] == "hit"
    assert images_hash(sum(second.base_images, [])) == images_hash(sum(first.base_images, []))
    base_metrics = {k: v for k, v in first.report["metrics"].items() if k.startswith("base_")}
    assert base_metrics and base_metrics == {k: second.report["metrics"][k] for k in base_metrics}
    assert first.report["metrics"]["clip_i"] != second.report["metrics"]["clip_i"]  # two fine-tunes
    assert first.report["protocol"]["id"] == second.report["protocol"]["id"]
    # every job of the base is in an entry: the prompts and the drift's class prompts
    for entry in (p for p in models["cache"].iterdir() if not p.name.startswith(".")):
        assert json.loads((entry / "manifest.json").read_text())["jobs"] == {"main": [1, 1], "drift": [1]}


def test_another_protocol_value_misses(cached, models):
    *_, other = cached
    assert other.report["generation"]["base_cache"] == "miss"
    assert len([p for p in models["cache"].iterdir() if not p.name.startswith(".")]) == 2
    assert not [p for p in models["cache"].iterdir() if p.name.startswith(".tmp-")]


def test_the_key_follows_the_base_the_jobs_and_the_precision(models, tmp_path):
    from tasks.common.families import build_tiny_pipeline
    from tasks.evaluate.base_cache import cache_key

    jobs = {"main": {"prompts": ["a toy"], "seed": 0, "num_inference_steps": 2}}
    key, settings = cache_key(models["base"], jobs, {"all": "f32"})
    assert key == cache_key(models["base"], json.loads(json.dumps(jobs)), {"all": "f32"})[0]
    other_base = build_tiny_pipeline("builtin:tiny-sd", 3, tmp_path / "other")
    for changed in (cache_key(other_base, jobs, {"all": "f32"}),
                    cache_key(models["base"], {"main": {**jobs["main"], "num_inference_steps": 3}}, {"all": "f32"}),
                    cache_key(models["base"], {**jobs, "drift": {"prompts": ["a toy"]}}, {"all": "f32"}),
                    cache_key(models["base"], jobs, {"all": "bf16"})):
        assert changed[0] != key
    assert set(settings["libraries"]) == {"torch", "diffusers", "transformers"} and len(settings["code"]) == 64


def test_an_interrupted_write_leaves_no_entry(tmp_path, monkeypatch):
    from PIL import Image

    from tasks.evaluate.base_cache import BaseImageCache

    images = [[Image.new("RGB", (8, 8), (i, 0, 0)) for i in range(2)]]
    entry = BaseImageCache(tmp_path / "cache" / "k", {"x": 1})
    saved = []

    def save_then_fail(self, path, *args, **kw):
        if saved:
            raise KeyboardInterrupt  # the run is stopped during the second image
        saved.append(path)
        return original(self, path, *args, **kw)

    original = Image.Image.save
    monkeypatch.setattr(Image.Image, "save", save_then_fail)
    with pytest.raises(KeyboardInterrupt):
        entry.store({"main": (images, 1.0)})
    assert entry.load() is None and list((tmp_path / "cache").iterdir()) == []
    monkeypatch.setattr(Image.Image, "save", original)
    entry.store({"main": (images, 1.0)})
    loaded = entry.load()["main"][0]
    assert [[im.tobytes() for im in row] for row in loaded] == [[im.tobytes() for im in row] for row in images]


def _rss_mb() -> float:
    with open("/proc/self/statm", encoding="ascii") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.fixture(scope="module")
def ordered(models, tmp_path_factory):
    """One run with its export, every load recorded: each pipeline and the encoders hold BALLAST_MB
    more (so that holding two of them at once shows in the RSS), and each load notes which of the
    earlier pipelines are still alive. A run without the ballast goes first (imports, first calls)."""
    import torch

    from tasks.common.scoring import Encoders
    from tasks.evaluate import core, phases

    if not os.path.exists("/proc/self/statm"):
        pytest.skip("peak RSS is measured from /proc (Linux only)")
    _, export, _ = exported(tmp_path_factory, "builtin:tiny-sd", **SHAPE)
    args = (models["tunes"][0], models["base"], models["data"], _config())
    core.evaluate(*args, export=export)
    events, alive = [], []

    def loading(name, load):
        def wrapper(*a, **kw):
            events.append((name, [n for n, ref in alive if ref() is not None]))
            loaded = load(*a, **kw)
            pipe = loaded[0] if isinstance(loaded, tuple) else loaded
            pipe.ballast = torch.ones(BALLAST_MB * 2**18)  # float32: BALLAST_MB MB, every page written
            alive.append((name, weakref.ref(pipe)))
            return loaded
        return wrapper

    mp = pytest.MonkeyPatch()
    mp.setattr(phases, "load_ov_pipeline", loading("export", phases.load_ov_pipeline))
    mp.setattr(phases, "load_finetuned", loading("finetuned", phases.load_finetuned))
    mp.setattr(phases, "load_base", loading("base", phases.load_base))
    mp.setattr(Encoders, "load", classmethod(loading("encoders", Encoders.load.__func__)))
    start = _rss_mb()
    try:
        result = core.evaluate(*args, export=export)
    finally:
        mp.undo()
    return {"events": events, "peaks": result.report["memory"]["peak_rss_mb"], "start": start,
            "report": result.report}


def test_one_pipeline_at_a_time_and_the_encoders_after_the_last(ordered):
    assert ordered["events"] == [("export", []), ("finetuned", []), ("base", []), ("encoders", [])]


def test_each_phase_peak_holds_one_large_model_not_two(ordered):
    """Each phase's peak is above the RSS at the start by its own ballast (so the measure sees it)
    and below one and a half of them: two models held together would be two ballasts (the sum of
    the phases' own increments is four)."""
    peaks = ordered["peaks"]
    assert list(peaks) == ["export", "finetuned", "base", "score"]
    for phase, peak in peaks.items():
        assert 0.9 * BALLAST_MB < peak - ordered["start"] < 1.5 * BALLAST_MB, (phase, peak, ordered["start"])


def test_an_encoder_that_cannot_load_is_refused_before_any_pipeline(models, monkeypatch):
    """The encoders load last, but a wrong name still stops the stage before minutes of generation."""
    from tasks.common.errors import UserError
    from tasks.evaluate import core, phases

    def refuse(*args, **kw):
        raise AssertionError("a pipeline was loaded")

    monkeypatch.setattr(phases, "load_finetuned", refuse)
    for key, cfg in (("evaluate.clip_model", _config(clip_model="builtin:tiny-clap")),
                     ("evaluate.dino_model", _config(dino_model=str(models["data"])))):  # no config.json
        with pytest.raises(UserError, match=key):
            core.evaluate(models["tunes"][0], models["base"], models["data"], cfg)
