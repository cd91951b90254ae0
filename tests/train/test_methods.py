"""Every method on both families: overfits a fixed batch, and its output loads through diffusers' own
loaders (DiffusionPipeline.from_pretrained, load_lora_weights, load_textual_inversion)."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tasks.train.config import TrainConfig
from tasks.train.core import train
from tasks.train.methods import METHODS
from tasks.train.models import load_components
from tasks.train.optim import make_optimizer

UNET = "unet/diffusion_pytorch_model.safetensors"
TEXT = "text_encoder/model.safetensors"
PIPELINES = {"sd": "StableDiffusionPipeline", "sdxl": "StableDiffusionXLPipeline"}


def cfg(tmp_path: Path, **kw) -> TrainConfig:
    base = dict(max_train_steps=20, train_batch_size=1, resolution=32, num_validation_images=0,
                with_prior_preservation=False, checkpoints_dir=tmp_path / "ckpt", checkpointing_steps=1000)
    return TrainConfig(**{**base, **kw})


def tensors_equal(a: Path, b: Path) -> bool:
    ta, tb = load_file(a), load_file(b)
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def family(base: Path) -> str:
    return "sdxl" if base.name.endswith("sdxl") else "sd"


def overfit(config: TrainConfig, base: Path, data: Path, out: Path) -> list[float]:
    """Train with the same noise, timesteps and VAE sample at every step (a fixed batch: one
    image, one prompt, and every step reads it as epoch 0, whose seeds give its noise); returns the
    losses from step 2 on."""
    from tasks.train.data import TrainDataset

    getitem = TrainDataset.__getitem__
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(TrainDataset, "__getitem__", lambda self, item: getitem(self, (0, item[1])))
        outcome = train(config, base, data, None, out)
    losses = [h.loss for h in outcome.history]
    assert all(math.isfinite(x) for x in losses)
    return losses[1:]


def test_dreambooth(tmp_path, tiny_base, one_image) -> None:
    from diffusers import DiffusionPipeline

    out = tmp_path / "out"
    losses = overfit(cfg(tmp_path, learning_rate=1e-3), tiny_base, one_image, out)
    assert losses[-1] < 0.3 * losses[0], losses
    assert type(DiffusionPipeline.from_pretrained(out)).__name__ == PIPELINES[family(tiny_base)]
    assert not tensors_equal(out / UNET, tiny_base / UNET), "the UNet trained"
    assert tensors_equal(out / TEXT, tiny_base / TEXT), "the text encoder is frozen by default"


def test_full_fine_tune_with_ema_and_min_snr(tmp_path, tiny_base, one_image) -> None:
    from diffusers import DiffusionPipeline

    out = tmp_path / "out"
    config = cfg(tmp_path, method="full", learning_rate=1e-3, use_ema=True, ema_decay=0.5, snr_gamma=5.0,
                 offload_ema=True, train_text_encoder=family(tiny_base) == "sdxl")
    losses = overfit(config, tiny_base, one_image, out)
    assert losses[-1] < 0.3 * losses[0], losses
    assert type(DiffusionPipeline.from_pretrained(out)).__name__ == PIPELINES[family(tiny_base)]
    assert not tensors_equal(out / UNET, tiny_base / UNET)
    if family(tiny_base) == "sdxl":
        name = "text_encoder_2/model.safetensors"
        assert not tensors_equal(out / name, tiny_base / name)


def test_lora(tmp_path, tiny_base, one_image) -> None:
    from diffusers import DiffusionPipeline

    sdxl = family(tiny_base) == "sdxl"
    out = tmp_path / "out"
    # SD: adapters on the UNet only, not fused; SDXL: on both text encoders too, fused for export.
    losses = overfit(cfg(tmp_path, method="lora", learning_rate=1e-2, rank=8, train_text_encoder=sdxl,
                         fuse_lora=sdxl), tiny_base, one_image, out)
    # Adapters on the attention projections only: less room than full weights, but a steady fall.
    assert losses[-1] < 0.95 * losses[0], losses
    assert sum(b < a for a, b in zip(losses, losses[1:])) >= 0.8 * (len(losses) - 1), losses
    weights = load_file(out / "pytorch_lora_weights.safetensors")
    assert {k.split(".")[0] for k in weights} == ({"unet", "text_encoder", "text_encoder_2"} if sdxl else {"unet"})
    assert all(w.dtype == torch.float32 for w in weights.values())
    pipe = DiffusionPipeline.from_pretrained(tiny_base)
    before = {k: v.clone() for k, v in pipe.unet.state_dict().items() if "to_q" in k}
    pipe.load_lora_weights(out)  # diffusers' own loader, from the folder
    pipe.fuse_lora()
    pipe.unload_lora_weights()
    after = {k: v for k, v in pipe.unet.state_dict().items() if k in before}
    assert any(not torch.equal(before[k], after[k]) for k in before), "the adapters change the UNet"
    assert (out / "model_index.json").is_file() == sdxl, "a fused full pipeline only with fuse_lora"
    if sdxl:
        fused = DiffusionPipeline.from_pretrained(out)
        assert not tensors_equal(out / UNET, tiny_base / UNET)
        for name in (TEXT, "text_encoder_2/model.safetensors"):  # fused, under the keys transformers loads
            assert load_file(out / name).keys() == load_file(tiny_base / name).keys(), name
            assert not tensors_equal(out / name, tiny_base / name), name
        assert torch.allclose(fused.unet.state_dict()[next(iter(after))], after[next(iter(after))], atol=1e-5)


def test_textual_inversion_outputs_load(tmp_path, tiny_base, instance_dir) -> None:
    from diffusers import DiffusionPipeline

    out = tmp_path / "out"
    config = cfg(tmp_path, method="textual_inversion", placeholder_token="<sks-toy>", initializer_token="toy",
                 num_vectors=2, max_train_steps=3, learning_rate=5e-2)
    train(config, tiny_base, instance_dir, None, out)
    embeds = load_file(out / "learned_embeds.safetensors")
    pipe = DiffusionPipeline.from_pretrained(tiny_base)
    if family(tiny_base) == "sd":
        assert set(embeds) == {"<sks-toy>"} and embeds["<sks-toy>"].shape == (2, 32)
        pipe.load_textual_inversion(out / "learned_embeds.safetensors")
        pairs = [(pipe.tokenizer, pipe.text_encoder, embeds["<sks-toy>"])]
    else:
        assert set(embeds) == {"clip_l", "clip_g"}
        pipe.load_textual_inversion(embeds["clip_l"], token="<sks-toy>", text_encoder=pipe.text_encoder,
                                    tokenizer=pipe.tokenizer)
        pipe.load_textual_inversion(embeds["clip_g"], token="<sks-toy>", text_encoder=pipe.text_encoder_2,
                                    tokenizer=pipe.tokenizer_2)
        pairs = [(pipe.tokenizer, pipe.text_encoder, embeds["clip_l"]),
                 (pipe.tokenizer_2, pipe.text_encoder_2, embeds["clip_g"])]
    full = DiffusionPipeline.from_pretrained(out)
    for tokenizer, encoder, rows in pairs:
        ids = tokenizer.convert_tokens_to_ids(["<sks-toy>", "<sks-toy>_1"])
        assert torch.equal(encoder.get_input_embeddings().weight[ids].detach(), rows)
        init = tokenizer.convert_tokens_to_ids("toy")
        assert not torch.equal(rows[0], encoder.get_input_embeddings().weight[init].detach()), "it trained"
    assert full.tokenizer.convert_tokens_to_ids("<sks-toy>") == pairs[0][0].convert_tokens_to_ids("<sks-toy>")
    assert torch.equal(full.text_encoder.get_input_embeddings().weight[:-2],
                       pipe.text_encoder.get_input_embeddings().weight[:-2]), "only the new rows differ"


def test_textual_inversion_overfits_a_fixed_batch(tiny_base, one_image) -> None:
    """The method's own objective on one batch with fixed noise: the loss falls at every step.

    It falls by well under 1% here, and that is the model, not the method: the built-in tiny UNet
    has random weights and barely reads its text conditioning (scaling the text encoder's output
    by 100 moves its loss by about 1%), and textual inversion can only change the text. The test
    therefore asserts a steady fall of a noise-free objective rather than a large one.
    """
    config = TrainConfig(method="textual_inversion", placeholder_token="<t>", initializer_token="toy",
                         resolution=32, with_prior_preservation=False, learning_rate=1e-1)
    torch.manual_seed(0)
    method = METHODS["textual_inversion"](config)
    dataset = method.dataset(one_image, None)
    method.bind(load_components(tiny_base))
    method.configure()
    method.place(torch.device("cpu"), torch.float32)
    method.setup_caches()
    trained = [p.shape for g in method.param_groups() for p in g["params"]]
    assert trained == [(1, e.config.hidden_size) for e in method.components.text_encoders], "placeholder rows only"
    optimizer = make_optimizer(config, method.param_groups(), config.learning_rate)
    batch = method.collate([dataset[(0, 0)]])
    losses = []
    for _ in range(12):
        torch.manual_seed(7)
        loss, _ = method.compute_loss(batch, method.components.modules)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        method.after_step()
        losses.append(loss.item())
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < losses[0] - 1e-3, losses


def test_placeholder_embedding_reads_its_rows_and_merges_back() -> None:
    """The training-time embedding gives what the merged plain one gives, and only `rows` get a gradient."""
    from tasks.train.methods.textual_inversion import PlaceholderEmbedding

    torch.manual_seed(0)
    plain = torch.nn.Embedding(10, 4)
    wrapped = PlaceholderEmbedding(plain, [8, 9])
    with torch.no_grad():
        wrapped.rows += 1.0
    ids = torch.tensor([[1, 8, 3, 9, 9]])
    out = wrapped(ids)
    assert torch.equal(out, wrapped.merged()(ids))
    assert torch.equal(out[0, 0], plain.weight[1]) and torch.equal(out[0, 1], plain.weight[8] + 1.0)
    out.sum().backward()
    assert wrapped.weight.grad is None and torch.equal(wrapped.rows.grad, torch.tensor([[1.0] * 4, [2.0] * 4]))


def test_fused_lora_keeps_the_precision_the_base_is_stored_in(tmp_path, tiny_sd, one_image) -> None:
    """A bf16 base (as SD3.5 and FLUX.1 are published) gives a bf16 fused pipeline, not a float32 one at
    twice the size on disk and in memory; the adapters themselves stay float32."""
    from diffusers import DiffusionPipeline

    from tasks.common.families import stored_dtypes

    base = tmp_path / "base-bf16"
    DiffusionPipeline.from_pretrained(tiny_sd, torch_dtype=torch.bfloat16).save_pretrained(base)
    assert set(stored_dtypes(base).values()) == {torch.bfloat16}
    out = tmp_path / "out"
    config = cfg(tmp_path, method="lora", max_train_steps=2, fuse_lora=True, mixed_precision="bf16")
    train(config, base, one_image, None, out)
    assert set(stored_dtypes(out).values()) == {torch.bfloat16}
    assert all(w.dtype == torch.float32 for w in load_file(out / "pytorch_lora_weights.safetensors").values())
    assert not tensors_equal(out / UNET, base / UNET), "the adapters are fused in"
    assert stored_dtypes(tiny_sd) == {"text_encoder": torch.float32, "unet": torch.float32, "vae": torch.float32}


@pytest.mark.parametrize("method,alive", [("lora", set()), ("dreambooth", {"unet"})])
def test_the_base_loads_for_the_output_with_training_let_go_of(tmp_path, tiny_sd, one_image, method, alive,
                                                                monkeypatch) -> None:
    """When the base is read again for the output (LoRA: its shards to fuse into; dreambooth: the
    frozen parts of the saved pipeline), the optimizer, the EMA and every module training held are
    gone but what is being saved: an SD3.5 base is 16 GB, it must not sit beside the training's."""
    import gc
    import weakref

    from diffusers import DiffusionPipeline

    import tasks.train.core as core
    import tasks.train.loop as loop
    from tasks.common import stream_fuse
    from tasks.common.families import Components

    refs: dict[str, weakref.ref] = {}
    real_components, real_optimizer, real_ema = core.load_components, loop.make_optimizer, loop.Ema
    real_load, real_denoiser = DiffusionPipeline.from_pretrained, Components.load_denoiser
    real_fuse_to = stream_fuse.fuse_to

    def load_components(*args, **kwargs):
        components = real_components(*args, **kwargs)
        refs.update({name: weakref.ref(module) for name, module in components.modules.items()})
        return components

    def load_denoiser(self, base, dtype=None, quantize=None):
        real_denoiser(self, base, dtype, quantize)
        refs["unet"] = weakref.ref(self.denoiser)

    def make_optimizer(*args, **kwargs):
        optimizer = real_optimizer(*args, **kwargs)
        refs["optimizer"] = weakref.ref(optimizer)
        return optimizer

    class Ema(real_ema):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            refs["ema"] = weakref.ref(self.model)

    alive_at_load: list[set[str]] = []

    def watched(real):  # the base loads (from_pretrained), or LoRA's fuse reads its shards (fuse_to)
        def call(*args, **kwargs):
            gc.collect()
            alive_at_load.append({name for name, ref in refs.items() if ref() is not None})
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(core, "load_components", load_components)
    monkeypatch.setattr(Components, "load_denoiser", load_denoiser)
    monkeypatch.setattr(loop, "make_optimizer", make_optimizer)
    monkeypatch.setattr(loop, "Ema", Ema)
    monkeypatch.setattr(DiffusionPipeline, "from_pretrained", watched(real_load))
    monkeypatch.setattr(stream_fuse, "fuse_to", watched(real_fuse_to))
    config = cfg(tmp_path, method=method, max_train_steps=2, fuse_lora=True, use_ema=method == "dreambooth")
    train(config, tiny_sd, one_image, None, tmp_path / "out")
    assert {"unet", "vae", "text_encoder", "optimizer"} <= set(refs), refs
    assert alive_at_load == [alive], alive_at_load
    gc.collect()
    assert not {name for name, ref in refs.items() if ref() is not None}, "all let go of once written"
