"""LTX-Video: trained on ingest's clips, conditioned and called as LTXPipeline does."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tasks.common import families
from tasks.common.errors import UserError
from tasks.common.families import PredictInputs
from tasks.common.scoring import split_frames
from tests.conftest import REPO
from tests.train.test_references import _config


@pytest.fixture(scope="module")
def clips_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo clips (data/demo/clips, `make data`) through the ingest stage at 64 px: two of 17 frames, one of 9."""
    from tests.ingest.util import config, run

    out = tmp_path_factory.mktemp("ltx") / "processed"
    run(config([{"type": "clips", "path": str(REPO / "data" / "demo" / "clips")}], video={"resolution": 64}), out)
    return out


@pytest.fixture(scope="module")
def ltx_pipe(tiny_ltx):
    from diffusers import LTXPipeline

    return LTXPipeline.from_pretrained(tiny_ltx)


def test_the_family_encodes_and_predicts_what_the_pipeline_computes(tiny_ltx, ltx_pipe) -> None:
    """The first step of LTXPipeline (17 frames, 64 px, no guidance), the transformer's call seen by a hook: the
    family's conditioning equals the pipeline's, its prediction from the unpacked latents is the
    transformer's output unpacked, and its generation is a filmstrip of the clip's frames."""
    from diffusers import LTXPipeline as Pipe

    family = families.detect(tiny_ltx)
    assert family.name == "ltx" and family.video
    seen = []
    hook = ltx_pipe.transformer.register_forward_hook(lambda m, a, kw, out: seen.append((kw, out[0])), with_kwargs=True)
    with torch.no_grad():
        clips = family.generate_clips(ltx_pipe, ["a toy robot waving"], steps=2, height=64, width=64, frames=17,
                                      guidance=1.0, generator=torch.Generator().manual_seed(0))
    hook.remove()
    assert len(clips[0]) == 17 and clips[0][0].size == (64, 64)
    kwargs, output = seen[0]
    components = family.load_components(tiny_ltx)
    ids = family.text.tokenize(components, ["a toy robot waving"])
    with torch.no_grad():
        hidden, mask = family.text.encode_prompt(components, ids)
    assert torch.equal(hidden, kwargs["encoder_hidden_states"])
    assert torch.equal(mask.bool(), kwargs["encoder_attention_mask"])
    assert (kwargs["num_frames"], kwargs["height"], kwargs["width"]) == (3, 2, 2)  # 17 frames / 8, 64 px / 32
    noisy = Pipe._unpack_latents(kwargs["hidden_states"], 3, 2, 2)
    inputs = PredictInputs(resolution=64, guidance_scale=1.0)
    with torch.no_grad():
        pred = family.denoiser.predict(ltx_pipe.transformer, noisy, kwargs["timestep"], hidden, mask, inputs)
    assert torch.equal(pred, Pipe._unpack_latents(output, 3, 2, 2))
    seed = torch.Generator().manual_seed(0)
    strip = family.generate(ltx_pipe, ["a toy"], steps=2, height=64, width=64, frames=17, generator=seed)[0]
    clip = family.generate_clips(ltx_pipe, ["a toy"], steps=2, height=64, width=64, frames=17,
                                 generator=torch.Generator().manual_seed(0))[0]
    assert strip.size == (17 * 64, 64)  # every frame, side by side; the scorer cuts them back
    assert [np.asarray(f).tolist() for f in split_frames(strip, 17)] == [np.asarray(f).tolist() for f in clip]


@pytest.mark.parametrize("method", ["lora", "full"])
def test_ltx_trains_on_the_demo_clips(tmp_path, tiny_ltx, clips_dir, method) -> None:
    """Two steps on the demo clips (batches of one bucket: 64x64 with 17 or 9 frames), latents cached
    before the first step, a validation filmstrip; the LoRA loads into LTXPipeline, the full fine-tune
    is an LTXPipeline folder whose transformer moved."""
    from diffusers import LTXPipeline

    from tasks.train.core import train

    rows = [json.loads(line) for line in (clips_dir / "clips.jsonl").read_text().splitlines()]
    assert sorted(r["bucket"] for r in rows) == ["64x64x17", "64x64x17", "64x64x9"]
    cfg = _config(tmp_path, method=method, resolution=64, train_batch_size=2, caption_column="text",
                  num_validation_images=1, validation_inference_steps=2)
    outcome = train(cfg, tiny_ltx, clips_dir, None, tmp_path / "out")
    losses = [h.loss for h in outcome.history]
    assert outcome.family == "ltx" and len(losses) == 2 and all(np.isfinite(losses)), losses
    assert next(iter(outcome.validation.values()))[0].size == (9 * 64, 64)  # a filmstrip of 9 frames
    base = LTXPipeline.from_pretrained(tiny_ltx)
    if method == "lora":
        base.load_lora_weights(tmp_path / "out")
        assert any("lora" in n for n, _ in base.transformer.named_parameters())
        return
    tuned = LTXPipeline.from_pretrained(tmp_path / "out")
    before, after = base.transformer.state_dict(), tuned.transformer.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("lora_type", ["lokr", "loha"])
def test_lokr_and_loha_train_on_the_demo_clips_and_change_the_transformer(tmp_path, tiny_ltx, clips_dir,
                                                                          lora_type) -> None:
    """LyCORIS' adapter types on the video transformer: one step on the demo clips writes peft's adapter
    folder (no diffusers LoRA file), which the served model's loader applies to LTXPipeline, moving the
    transformer's weights."""
    from diffusers import LTXPipeline

    from finetune_runtime.adapters import apply_peft
    from finetune_runtime.layout import PEFT_DIR, peft_components
    from tasks.train.core import train

    cfg = _config(tmp_path, method="lora", lora_type=lora_type, resolution=64, train_batch_size=2,
                  caption_column="text", max_train_steps=1)
    outcome = train(cfg, tiny_ltx, clips_dir, None, tmp_path / "out")
    assert outcome.family == "ltx" and np.isfinite(outcome.history[0].loss)
    assert peft_components(tmp_path / "out" / PEFT_DIR) == ["transformer"]
    assert not (tmp_path / "out" / "pytorch_lora_weights.safetensors").exists()
    pipe = LTXPipeline.from_pretrained(tiny_ltx)
    before = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}
    apply_peft(pipe, tmp_path / "out" / PEFT_DIR)
    after = pipe.transformer.state_dict()
    assert after.keys() == before.keys() and any(not torch.equal(before[k], after[k]) for k in before)


def test_ltx_refuses_data_without_clips_and_prior_preservation(tmp_path, tiny_ltx, instance_dir) -> None:
    from tasks.train.core import train

    with pytest.raises(UserError, match=r"clips.jsonl not found: a video model trains on clips"):
        train(_config(tmp_path, method="lora"), tiny_ltx, instance_dir, None, tmp_path / "out")
    with pytest.raises(UserError, match=r"with_prior_preservation: LTX-Video trains on clips.*set "
                                        r"train.with_prior_preservation: false"):
        train(_config(tmp_path, method="lora", with_prior_preservation=True), tiny_ltx, instance_dir, None,
              tmp_path / "out")


def test_the_served_model_answers_a_playable_mp4_and_counts_every_frame(ltx_pipe) -> None:
    """The registered model's predict on LTX-Video (diffusers back end): one row per clip with a base64
    MP4 of the convention's frames (or num_frames), decoded here with PyAV, from text or from text and
    a first image; the budget counts frames x steps x pixels, and a request over it is a 400 naming
    the frames, as is a length the VAE does not take."""
    import base64
    import io

    import av
    from mlflow.exceptions import MlflowException

    from finetune_runtime.limits import Budget, signature
    from finetune_runtime.load import Loaded
    from finetune_runtime.model import DiffusionImageModel

    family = families.of_pipeline(ltx_pipe)
    model = DiffusionImageModel()
    model.serve(Loaded(ltx_pipe, "diffusers", "tiny-ltx"), {"pipeline_call": family.call_convention().as_config(),
                                                            "budget_images": 1})
    frames = family.call_convention().frames
    assert model.budget == Budget(1.0, 512, 512, frames=frames) and model.shape.multiple == 32
    out = model.predict(None, ["a toy robot waving"], {"height": 64, "width": 64, "num_inference_steps": 2})
    assert list(out.columns) == ["prompt", "seed", "video"] and len(out) == 1
    with av.open(io.BytesIO(base64.b64decode(out["video"][0]))) as clip:
        stream = clip.streams.video[0]
        decoded = [f.to_ndarray(format="rgb24") for f in clip.decode(stream)]
        assert stream.codec_context.name == "h264" and float(stream.average_rate) == family.call_convention().fps
    assert len(decoded) == frames and decoded[0].shape == (64, 64, 3)
    out = model.predict(None, ["a"], {"height": 64, "width": 64, "num_inference_steps": 2, "num_frames": 17})
    with av.open(io.BytesIO(base64.b64decode(out["video"][0]))) as clip:
        assert sum(1 for _ in clip.decode(video=0)) == 17
    # text and a first image: LTXImageToVideoPipeline on the same model, the clip at the image's size
    first = io.BytesIO()
    Image.new("RGB", (96, 64), (220, 40, 40)).save(first, format="PNG")
    params = {"num_inference_steps": 2, "image": base64.b64encode(first.getvalue()).decode()}
    started = model.predict(None, ["a toy robot waving"], params)
    with av.open(io.BytesIO(base64.b64decode(started["video"][0]))) as clip:
        frames = [f.to_ndarray(format="rgb24") for f in clip.decode(video=0)]
    assert len(frames) == 9 and frames[0].shape == (64, 96, 3)
    assert type(model.first_frame).__name__ == "LTXImageToVideoPipeline"
    assert model.first_frame.transformer is ltx_pipe.transformer  # the same modules, not a second copy
    with pytest.raises(MlflowException, match=r"height 512 x width 512 x num_frames 9 = .* over this model's budget .*"
                                              r"1 clips of 9 frames of 512x512 px"):
        model.predict(None, ["a", "b"], {"num_inference_steps": 20})
    with pytest.raises(MlflowException, match=r"num_frames: 16 is not 8k\+1 frames, which this model's VAE takes; "
                                              r"allowed: 9, 17, 25"):
        model.predict(None, ["a"], {"num_frames": 16})
    assert "num_frames" in [p.name for p in signature(video=True).params.params]
    assert "num_frames" not in [p.name for p in signature().params.params]


# image-to-video training (train.first_frame_conditioning_p), as LTXImageToVideoPipeline runs the model


@pytest.fixture(scope="module")
def ltx_lora(tmp_path_factory, tiny_ltx, clips_dir):
    """A LoRA method on the tiny LTX-Video with its caches, and a batch of the two 17-frame demo clips."""
    from tasks.train.methods import METHODS
    from tasks.train.models import load_components

    tmp = tmp_path_factory.mktemp("ltx_i2v")
    method = METHODS["lora"](_config(tmp, method="lora", resolution=64, caption_column="text"))
    dataset = method.dataset(clips_dir, None, True)
    components = load_components(tiny_ltx)
    method.bind(components)
    method.configure()
    method.setup_caches()
    examples = [dataset[(0, i)] for i in range(len(dataset))]
    batch = method.collate([e for e in examples if e["instance"]["pixels"].shape[1] == 17])
    assert len(batch.noise_seeds) == 2
    return method, components, batch


def _loss(method, components, batch, **settings) -> torch.Tensor:
    """The batch's loss with `settings` over the method's config (the same draws: seeded per row)."""
    cfg = method.cfg
    method.cfg = cfg.model_copy(update=settings)
    try:
        with torch.no_grad():
            return method.compute_loss(batch, components.modules)[0]
    finally:
        method.cfg = cfg


def test_a_conditioned_clip_keeps_its_first_frame_clean_at_timestep_0_and_out_of_the_loss(
        ltx_lora, monkeypatch) -> None:
    """p = 1: the transformer's input holds the clean latents in latent frame 0 and the noised ones after,
    its (b, tokens) timestep is 0 on frame 0's tokens and the row's own after; the loss is the mean over
    frames 1.. only, and does not move when frame 0's prediction does."""
    from diffusers import LTXPipeline as Pipe

    method, components, batch = ltx_lora
    noise, drawn, seen = method.objective.noise, [], []
    monkeypatch.setattr(method.objective, "noise", lambda latents, rand: drawn.append((latents, noise(latents, rand)))
                        or drawn[-1][1])
    denoiser = components.modules["transformer"]
    hook = denoiser.register_forward_hook(lambda m, a, kw, out: seen.append((kw, out[0])), with_kwargs=True)
    loss = _loss(method, components, batch, first_frame_conditioning_p=1.0)
    hook.remove()
    ((latents, noised),), ((kwargs, out),) = drawn, seen
    _, _, f, h, w = latents.shape
    assert (f, h, w) == (3, 2, 2)  # 17 frames / 8 + 1, 64 px / 32
    given = Pipe._unpack_latents(kwargs["hidden_states"], f, h, w)
    assert torch.equal(given[:, :, 0], latents[:, :, 0])
    assert torch.equal(given[:, :, 1:], noised.noisy_latents[:, :, 1:])
    timestep = kwargs["timestep"]
    assert timestep.shape == (2, f * h * w) and (timestep[:, :h * w] == 0).all()
    assert torch.equal(timestep[:, h * w:], noised.timesteps[:, None].expand(2, (f - 1) * h * w))
    assert (noised.timesteps > 0).all()
    pred = Pipe._unpack_latents(out, f, h, w)
    frames_after = ((pred[:, :, 1:].float() - noised.target[:, :, 1:].float()) ** 2).mean(dim=(1, 2, 3, 4)).mean()
    assert torch.allclose(loss, frames_after, rtol=1e-5, atol=0), (loss, frames_after)
    role = type(components.family.denoiser)
    predict = role.predict

    def frame_0_moved(self, *args):
        pred = predict(self, *args).clone()
        pred[:, :, 0] += 100.0
        return pred

    monkeypatch.setattr(role, "predict", frame_0_moved)
    assert torch.equal(_loss(method, components, batch, first_frame_conditioning_p=1.0), loss)
    monkeypatch.setattr(role, "predict", predict)
    assert not torch.equal(_loss(method, components, batch), loss)


def test_without_first_frame_conditioning_the_loss_is_exactly_todays(ltx_lora, monkeypatch) -> None:
    """p = 0 draws nothing (the step as without the option); a p that draws no row changes nothing either:
    both equal the loss of a step where the conditioning does not exist (its draw never returns a row)."""
    from tasks.train.objectives import FirstFrame

    method, components, batch = ltx_lora
    assert method.cfg.first_frame_conditioning_p == 0.0
    with monkeypatch.context() as patched:
        patched.setattr(FirstFrame, "draw", classmethod(lambda cls, p, latents, rand: None))
        without = _loss(method, components, batch, first_frame_conditioning_p=1.0)
    assert torch.equal(_loss(method, components, batch), without)
    assert torch.equal(_loss(method, components, batch, first_frame_conditioning_p=1e-12), without)
    assert not torch.equal(_loss(method, components, batch, first_frame_conditioning_p=1.0), without)


def test_each_clip_draws_its_conditioning_from_its_own_seed() -> None:
    """A row's draw depends on its seed only, not on the batch it is in."""
    from tasks.train.diffusion import RowRandom
    from tasks.train.objectives import FirstFrame

    latents = torch.zeros(8, 4, 3, 2, 2)
    seeds = list(range(100, 108))
    together = FirstFrame.draw(0.5, latents, RowRandom(seeds)).rows
    alone = [FirstFrame.draw(0.5, latents[:1], RowRandom([s])) for s in seeds]
    assert together.tolist() == [a is not None for a in alone] and 0 < int(together.sum()) < 8
    assert FirstFrame.draw(1.0, latents[:, :, :1], RowRandom(seeds)) is None  # one latent frame: nothing to continue
    assert FirstFrame.draw(0.0, latents, RowRandom(seeds)) is None


def test_first_frame_conditioning_is_refused_for_an_image_family(tmp_path) -> None:
    from tasks.train.config import TrainConfig

    cfg = TrainConfig(method="lora", with_prior_preservation=False, first_frame_conditioning_p=0.5)
    images = [f for f in families.FAMILIES if not f.video]
    objectives = {f.denoiser.objective for f in images}
    assert images and {"flow_matching", "ddpm"} <= objectives
    for family in images:
        title = re.escape(family.title)
        with pytest.raises(UserError, match=rf"train.first_frame_conditioning_p: trains a video family's clips as "
                                            rf"image-to-video .*; {title} makes images, not clips; remove it or set "
                                            rf"it to 0.0"):
            cfg.check_family(family)
    for family in families.FAMILIES:
        if family.video:
            cfg.check_family(family)  # a video family takes it


def test_a_lora_trains_as_image_to_video_on_the_demo_clips(tmp_path, tiny_ltx, clips_dir) -> None:
    """Two LoRA steps with every clip conditioned on its first frame, through the train stage's function:
    finite losses, and a LoRA that loads into LTXImageToVideoPipeline."""
    from diffusers import LTXImageToVideoPipeline

    from tasks.train.core import train

    cfg = _config(tmp_path, method="lora", resolution=64, train_batch_size=2, caption_column="text",
                  first_frame_conditioning_p=1.0)
    outcome = train(cfg, tiny_ltx, clips_dir, None, tmp_path / "out")
    losses = [h.loss for h in outcome.history]
    assert outcome.family == "ltx" and len(losses) == 2 and all(np.isfinite(losses)), losses
    pipe = LTXImageToVideoPipeline.from_pretrained(tiny_ltx)
    pipe.load_lora_weights(tmp_path / "out")
    assert any("lora" in n for n, _ in pipe.transformer.named_parameters())
