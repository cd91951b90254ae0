"""SD3, FLUX.1, FLUX.2 klein, Z-Image, Qwen-Image and Sana (flow-matching transformers) through the train
stage: each method overfits a fixed batch and its output loads with the family's own diffusers class;
exact resume holds; what the family lacks is refused before any weights load, naming the key."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tasks.common.errors import UserError
from tasks.common.families import detect
from tasks.train.config import TrainConfig
from tasks.train.core import train
from tests.train.test_methods import cfg, overfit, tensors_equal

TRANSFORMER = "transformer/diffusion_pytorch_model.safetensors"
SEQ = 32  # text tokens per prompt: T5's, or Qwen3's with FLUX.2's chat template (14 tokens) around the prompt


def generates(pipe) -> None:
    image = pipe(prompt="a photo of sks toy", num_inference_steps=2, height=32, width=32, output_type="np",
                 max_sequence_length=SEQ).images[0]
    assert image.shape == (32, 32, 3) and torch.isfinite(torch.from_numpy(image)).all()


def test_dreambooth_with_prior_preservation(tmp_path, flow_base, one_image, class_dir) -> None:
    from diffusers import DiffusionPipeline

    out = tmp_path / "out"
    config = cfg(tmp_path, learning_rate=1e-3, with_prior_preservation=True, max_train_steps=4,
                 max_sequence_length=SEQ)
    outcome = train(config, flow_base, one_image, class_dir, out)
    assert all("prior_loss" in h.extra for h in outcome.history)
    single = overfit(cfg(tmp_path / "single", learning_rate=1e-2, max_train_steps=40, max_sequence_length=SEQ),
                     flow_base, one_image, tmp_path / "single-out")
    assert single[-1] < 0.3 * single[0], single
    pipe = DiffusionPipeline.from_pretrained(out)
    assert type(pipe) is detect(flow_base).pipeline.diffusers_class()
    assert not tensors_equal(out / TRANSFORMER, flow_base / TRANSFORMER), "the transformer trained"
    assert tensors_equal(out / "text_encoder/model.safetensors", flow_base / "text_encoder/model.safetensors")
    generates(pipe)


def test_lora_loads_with_the_family_pipeline(tmp_path, flow_base, one_image) -> None:
    family = detect(flow_base)
    out = tmp_path / "out"
    with_text = bool(family.text.trainable)  # FLUX.2 klein: the transformer only
    losses = overfit(cfg(tmp_path, method="lora", learning_rate=1e-2, rank=8, train_text_encoder=with_text,
                         max_sequence_length=SEQ), flow_base, one_image, out)
    assert losses[-1] < 0.95 * losses[0], losses
    weights = load_file(out / "pytorch_lora_weights.safetensors")
    # T5 never gets adapters (as in diffusers' scripts); the CLIP encoders do with train_text_encoder.
    assert {k.split(".")[0] for k in weights} == {"transformer", *family.text.trainable}
    pipe = family.pipeline.diffusers_class().from_pretrained(flow_base)
    # Every adapted layer of the file (their B matrices start at zero) changes when fused: none is
    # left out by the loader, whatever the file's key format.
    adapted = {k.removeprefix("transformer.").split(".lora")[0] for k in weights if k.startswith("transformer.")}
    before = {name: pipe.transformer.get_submodule(name).weight.clone() for name in adapted}
    pipe.load_lora_weights(out)
    pipe.fuse_lora()
    pipe.unload_lora_weights()
    unchanged = [n for n in adapted if torch.equal(before[n], pipe.transformer.get_submodule(n).weight)]
    assert adapted and not unchanged, unchanged
    for name in family.text.trainable:  # fused, under the keys transformers loads
        fused_weights = load_file(out / name / "model.safetensors")
        base_weights = load_file(flow_base / name / "model.safetensors")
        assert fused_weights.keys() == base_weights.keys(), name
        assert not tensors_equal(out / name / "model.safetensors", flow_base / name / "model.safetensors"), name
    fused = family.pipeline.diffusers_class().from_pretrained(out)  # fuse_lora: the full pipeline beside the adapters
    streamed = fused.transformer.state_dict()  # fused shard by shard (tasks/common/stream_fuse.py):
    vae = sorted((flow_base / "vae").glob("*.safetensors"))  # what it does not fuse, it links
    assert vae and all((out / "vae" / f.name).samefile(f) for f in vae)
    assert all(torch.allclose(streamed[f"{n}.weight"], pipe.transformer.get_submodule(n).weight, atol=1e-6)
               for n in adapted)
    generates(fused)


def test_full_fine_tune_with_a_weighting_scheme(tmp_path, flow_base, one_image) -> None:
    out = tmp_path / "out"
    config = cfg(tmp_path, method="full", learning_rate=1e-2, weighting_scheme="cosmap", use_ema=True,
                 ema_decay=0.5, max_sequence_length=SEQ)
    losses = overfit(config, flow_base, one_image, out)
    assert losses[-1] < 0.8 * losses[0], losses
    assert not tensors_equal(out / TRANSFORMER, flow_base / TRANSFORMER)


def test_a_run_trains_with_shifted_timesteps(tmp_path, tiny_flux, one_image) -> None:
    """FLUX's resolution-dependent shift and a sigmoid density (their sigmas: tests/train/test_timesteps.py)."""
    losses = overfit(cfg(tmp_path, method="lora", learning_rate=3e-2, rank=4, max_train_steps=8,
                         max_sequence_length=SEQ, fuse_lora=False, timestep_shift="auto", timestep_sampling="sigmoid",
                         sigmoid_scale=1.5), tiny_flux, one_image, tmp_path / "out")
    assert losses[-1] < 0.97 * losses[0], losses


def test_four_steps_equal_two_plus_resume_plus_two(tmp_path, tiny_flux, instance_dir, class_dir) -> None:
    kw = dict(max_train_steps=4, train_batch_size=1, resolution=32, num_validation_images=0, learning_rate=1e-3,
              weighting_scheme="logit_normal", checkpointing_steps=2, max_sequence_length=SEQ)
    straight = train(TrainConfig(**kw, checkpoints_dir=tmp_path / "a", resume="none"), tiny_flux, instance_dir,
                     class_dir, tmp_path / "straight")

    class Stop(Exception):
        pass

    def stop_after_two(entry) -> None:
        if entry.step == 2:
            raise Stop

    config = TrainConfig(**kw, checkpoints_dir=tmp_path / "b")
    with pytest.raises(Stop):
        train(config, tiny_flux, instance_dir, class_dir, tmp_path / "resumed", callbacks=[stop_after_two])
    resumed = train(config, tiny_flux, instance_dir, class_dir, tmp_path / "resumed")
    assert resumed.resumed_from == 2
    assert [h[1] for h in resumed.losses] == pytest.approx([h[1] for h in straight.losses], rel=1e-6)
    a, b = load_file(tmp_path / "straight" / TRANSFORMER), load_file(tmp_path / "resumed" / TRANSFORMER)
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


@pytest.mark.parametrize("base_name, setting, key", [
    ("tiny_flux", dict(method="textual_inversion", placeholder_token="<t>", initializer_token="toy",
                       with_prior_preservation=False), "train.method"),
    ("tiny_sd3", dict(snr_gamma=5.0), "train.snr_gamma"),
    ("tiny_flux", dict(prediction_type="v_prediction"), "train.prediction_type"),
    ("tiny_sd", dict(weighting_scheme="logit_normal"), "train.weighting_scheme"),
    ("tiny_sd3", dict(launcher="xla"), "train.launcher"),
    ("tiny_flux2", dict(train_text_encoder=True), "train.train_text_encoder"),
    ("tiny_zimage", dict(train_text_encoder=True), "train.train_text_encoder"),
    ("tiny_qwenimage", dict(train_text_encoder=True), "train.train_text_encoder"),
    ("tiny_sana", dict(train_text_encoder=True), "train.train_text_encoder"),
    # settings the family never reads: refused, not ignored
    ("tiny_sd", dict(guidance_scale=2.0), "train.guidance_scale"),
    ("tiny_sd3", dict(guidance_scale=2.0), "train.guidance_scale"),
    ("tiny_flux", dict(logit_std=2.0), "train.logit_std"),  # FLUX's scheme is none unless set
    ("tiny_sd3", dict(mode_scale=1.0), "train.mode_scale"),  # SD3's is logit_normal
    ("tiny_sd", dict(timestep_shift=3.0), "train.timestep_shift"),
    ("tiny_sd", dict(timestep_sampling="sigmoid"), "train.timestep_sampling"),
    ("tiny_sd3", dict(sigmoid_scale=2.0), "train.sigmoid_scale"),  # read by timestep_sampling: sigmoid only
])
def test_what_a_family_lacks_is_refused_before_loading(request, monkeypatch, tmp_path, instance_dir, base_name,
                                                        setting, key) -> None:
    import tasks.train.core as core

    base: Path = request.getfixturevalue(base_name)
    monkeypatch.setattr(core, "load_components", lambda *a, **k: pytest.fail("weights loaded before the check"))
    with pytest.raises(UserError, match=key.replace(".", r"\.")) as err:
        train(cfg(tmp_path, **setting), base, instance_dir, None, tmp_path / "out")
    assert detect(base).title in str(err.value)
    assert not (tmp_path / "out").exists()


def test_text_encoders_leave_before_the_first_step(tmp_path, tiny_flux, instance_dir, class_dir) -> None:
    """With the text cache on, every prompt is encoded up front and the encoders (T5 above all) are let go."""
    from tasks.train.methods import METHODS
    from tasks.train.models import load_components

    config = cfg(tmp_path, with_prior_preservation=True, proportion_empty_prompts=0.1, max_sequence_length=SEQ)
    method = METHODS["dreambooth"](config)
    method.dataset(instance_dir, class_dir)
    components = load_components(tiny_flux)
    method.bind(components)
    method.configure()
    method.setup_caches()
    family = components.family
    ids = family.text.tokenize(components, ["a photo of a toy"], SEQ)
    with torch.no_grad():
        expected = family.text.encode_prompt(components, ids)
    method.release_text_encoders()
    assert not any(name.startswith("text_encoder") for name in components.modules)
    assert set(method.prompt_cache.store) == {"a photo of sks toy", "a photo of a toy", ""}
    hidden, pooled = method.prompt_cache.lookup(["a photo of a toy"], ids, None, torch.device("cpu"))
    assert torch.equal(hidden, expected[0]) and torch.equal(pooled, expected[1])
    with pytest.raises(RuntimeError, match="not in the text cache"):
        method.prompt_cache.lookup(["another prompt"], ids, None, torch.device("cpu"))


def test_prompts_are_encoded_before_the_transformer_loads(tmp_path, tiny_sd3, one_image, monkeypatch) -> None:
    """With the text cache on, the text encoders (T5 among them) have left memory when the transformer
    is loaded, and the trained weights are those of the order where the transformer loads first."""
    import gc
    import weakref

    import tasks.train.core as core
    from tasks.common.families import Components

    real_components, real_denoiser = core.load_components, Components.load_denoiser
    encoders: dict[str, weakref.ref] = {}
    alive_at_load: list[set[str]] = []

    def load_components(*args, **kwargs):
        components = real_components(*args, **kwargs)
        encoders.update({n: weakref.ref(components.modules[n]) for n in components.text_encoder_names()})
        return components

    def load_denoiser(self, base, dtype=None, quantize=None):
        gc.collect()
        alive_at_load.append({n for n, ref in encoders.items() if ref() is not None})
        real_denoiser(self, base, dtype, quantize)

    monkeypatch.setattr(core, "load_components", load_components)
    monkeypatch.setattr(Components, "load_denoiser", load_denoiser)
    config = cfg(tmp_path, method="lora", max_train_steps=2, max_sequence_length=SEQ, fuse_lora=False,
                 mixed_precision="bf16")
    train(config, tiny_sd3, one_image, None, tmp_path / "first")
    assert set(encoders) == {"text_encoder", "text_encoder_2", "text_encoder_3"}
    assert alive_at_load == [set()], alive_at_load
    monkeypatch.setattr(core, "caches_on_host", lambda accelerator: False)  # as under XLA: encoders stay
    train(config, tiny_sd3, one_image, None, tmp_path / "late")
    assert alive_at_load[1] == set(encoders), alive_at_load
    weights = "pytorch_lora_weights.safetensors"
    assert tensors_equal(tmp_path / "first" / weights, tmp_path / "late" / weights)
