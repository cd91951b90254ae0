"""The family seam: saved folders are recognised by their family, unknown pipelines are refused naming what is
supported, and the locally learned T5 tokenizer is read back by transformers' own T5TokenizerFast."""
from __future__ import annotations

import pytest
import torch

from tasks.common import families
from tasks.common.errors import UserError

pytestmark = pytest.mark.quick  # make test-fast


@pytest.mark.parametrize("kind, latent_channels", [("builtin:tiny-sd3", 16), ("builtin:tiny-flux", 16),
                                                    ("builtin:tiny-flux2", 8), ("builtin:tiny-sana", 4)])
def test_builtins_are_recognised(tmp_path, kind, latent_channels) -> None:
    """(Same seed, same bytes: tests/base/test_base.py, for every built-in.)"""
    family = families.BUILTINS[kind]
    a = families.build_tiny_pipeline(kind, 0, tmp_path / "a")
    assert families.detect(a) is family
    pipe = family.pipeline_class().from_pretrained(a)
    assert pipe.vae.config.latent_channels == latent_channels and families.of_pipeline(pipe) is family


def test_the_t5_tokenizer_loads_with_transformers(tmp_path) -> None:
    from transformers import T5TokenizerFast

    families.build_tiny_pipeline("builtin:tiny-flux", 0, tmp_path)
    tok = T5TokenizerFast.from_pretrained(tmp_path / "tokenizer_2")
    ids = tok("a photo of sks toy", padding="max_length", max_length=16).input_ids
    assert len(ids) == 16 and ids.count(tok.eos_token_id) == 1 and ids[-1] == tok.pad_token_id == 0
    assert tok.decode(ids, skip_special_tokens=True) == "a photo of sks toy"


def test_every_family_says_what_the_stages_ask() -> None:
    for family in families.FAMILIES:
        assert family.builtin in families.BUILTINS and families.by_name(family.name) is family
        assert family.pipeline_class().__name__ in family.pipeline_class_names
        assert family.ov_pipeline_class().__name__ == family.ov_pipeline_class_name
        assert family.objective in ("ddpm", "flow_matching")
        assert len(family.text_encoder_names) == len(family.tokenizer_names)
        assert family.matches({"_class_name": family.pipeline_class_names[0]})
    matched = [f for f in families.FAMILIES for g in families.FAMILIES if f.matches(
        {"_class_name": g.pipeline_class_names[0]}) and f is not g]
    assert not matched, "each pipeline class belongs to one family"


def test_an_unknown_pipeline_is_refused_naming_the_supported_ones() -> None:
    with pytest.raises(UserError, match="KandinskyPipeline.*not supported.*FLUX.1"):
        families.from_index({"_class_name": "KandinskyPipeline"}, "base.model")


@pytest.mark.parametrize("kind", ["builtin:tiny-sd3", "builtin:tiny-flux", "builtin:tiny-flux2", "builtin:tiny-sana"])
def test_conditioning_has_the_pipelines_layout(tmp_path, kind) -> None:
    """Training's prompt encoding equals the pipeline's own encode_prompt (SD3: CLIP-L|CLIP-G padded,
    then T5; FLUX: T5's sequence, CLIP's pooled output; FLUX.2 klein: Qwen3's layers 9, 18, 27 of the
    chat-templated prompt, nothing pooled; Sana: Gemma-2's last hidden state of the lowercased prompt
    padded on the right, its attention mask where the pooled output goes), for a batch of prompts of
    different lengths."""
    path = families.build_tiny_pipeline(kind, 0, tmp_path)
    family = families.detect(path)
    components = family.load_components(path)
    prompts = ["a photo of sks toy", "a red cube on the beach"]
    ids = family.tokenize(components, prompts, max_sequence_length=32)
    more = [prompts] * (len(family.text_encoder_names) - 1)  # prompt_2 (, prompt_3)
    with torch.no_grad():
        hidden, pooled = family.encode_prompt(components, ids)
        pipe = family.pipeline_class().from_pretrained(path)
        extra = {"do_classifier_free_guidance": False} if family.name in ("sd3", "sana") else {}
        out = pipe.encode_prompt(prompts, *more, max_sequence_length=32, **extra)
    pooled_at = {"sd3": 2, "flux": 1, "flux2": None, "sana": 1}[family.name]  # where encode_prompt returns it
    ref, ref_pooled = out[0], None if pooled_at is None else out[pooled_at]
    assert hidden.shape == ref.shape and torch.allclose(hidden, ref, atol=1e-5)
    assert (pooled is None) if ref_pooled is None else torch.allclose(pooled, ref_pooled.to(pooled.dtype), atol=1e-5)
    if family.name == "sana":  # a mask: the shorter prompt's tail is padding
        assert 0 < pooled[0].sum() < pooled[1].sum() and pooled[:, -1].sum() == 0


def test_sana_generates_from_the_conditioning_it_trains_on(tmp_path) -> None:
    """What the transformer sees when the family generates (the call convention: no complex human
    instruction) is what training encodes, at the default 300 tokens; the pipeline's own default
    (the instruction before the prompt) is not."""
    family = families.BUILTINS["builtin:tiny-sana"]
    path = families.build_tiny_pipeline("builtin:tiny-sana", 0, tmp_path)
    pipe = family.pipeline_class().from_pretrained(path)
    seen = []
    pipe.transformer.register_forward_pre_hook(
        lambda _m, _a, kw: seen.append((kw["encoder_hidden_states"][-1], kw["encoder_attention_mask"][-1])),
        with_kwargs=True)
    components = family.load_components(path)
    with torch.no_grad():
        hidden, mask = family.encode_prompt(components, family.tokenize(components, ["A photo of sks toy"]))
        latents = torch.randn(1, 4, 8, 8)
        family.generate(pipe, ["A photo of sks toy"], steps=1, height=32, width=32, latents=latents)
        pipe(prompt="A photo of sks toy", num_inference_steps=1, height=32, width=32, latents=latents)
    (ours, our_mask), (default, _) = seen
    assert hidden.shape[1] == 300 and torch.allclose(ours, hidden[0], atol=1e-5) and torch.equal(our_mask, mask[0])
    assert not torch.allclose(default, hidden[0], atol=1e-3)
