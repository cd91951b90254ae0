"""The family seam: saved folders are recognised by their family, unknown pipelines are refused naming what is
supported, and the locally learned T5 tokenizer is read back by transformers' own T5TokenizerFast."""
from __future__ import annotations

import pytest
import torch

from tasks.common import families
from tasks.common.errors import UserError

pytestmark = pytest.mark.quick  # make test-fast


@pytest.mark.parametrize("kind, latent_channels", [("builtin:tiny-sd3", 16), ("builtin:tiny-flux", 16),
                                                    ("builtin:tiny-flux2", 8), ("builtin:tiny-zimage", 16),
                                                    ("builtin:tiny-qwenimage", 4), ("builtin:tiny-sana", 4),
                                                    ("builtin:tiny-ltx", 8)])
def test_builtins_are_recognised(tmp_path, kind, latent_channels) -> None:
    """(Same seed, same bytes: tests/base/test_base.py, for every built-in.)"""
    family = families.BUILTINS[kind]
    a = families.build_tiny_pipeline(kind, 0, tmp_path / "a")
    assert families.detect(a) is family
    pipe = family.pipeline.diffusers_class().from_pretrained(a)
    channels = pipe.vae.config.get("latent_channels", pipe.vae.config.get("z_dim"))  # (Qwen-Image's 3D VAE: z_dim)
    assert channels == latent_channels and families.of_pipeline(pipe) is family


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
        assert family.pipeline.diffusers_class().__name__ in family.pipeline.names
        if family.export.ov_pipeline is None:  # optimum-intel has none: the export says what to set
            with pytest.raises(UserError, match=f"no OpenVINO pipeline for {family.title}.*export.enabled: false"):
                family.export.ov_pipeline_class()
        else:
            assert family.export.ov_pipeline_class().__name__ == family.export.ov_pipeline
        assert family.denoiser.objective in ("ddpm", "flow_matching")
        assert len(family.text.encoder_names) == len(family.text.tokenizer_names)
        assert family.pipeline.matches({"_class_name": family.pipeline.names[0]})
    matched = [f for f in families.FAMILIES for g in families.FAMILIES if f.pipeline.matches(
        {"_class_name": g.pipeline.names[0]}) and f is not g]
    assert not matched, "each pipeline class belongs to one family"


#: ModelFamily's members today (52 before the export, latent and text roles, 31 before the denoiser,
#: input-image and pipeline-class roles);
#: the issue's aim is about 12
MAX_FAMILY_MEMBERS = 14


def test_new_family_facts_go_into_roles() -> None:
    """The interface does not grow: a new fact joins a role (export profile, latent codec, text
    conditioner, denoiser, call convention); the export profile, the text conditioner and the denoiser
    carry the family's title for their messages; roles are shared records, not per-family copies of the
    interface."""
    from tasks.common.families.base import ModelFamily
    from tasks.common.families.denoiser import Denoiser
    from tasks.common.families.export_profile import ExportProfile
    from tasks.common.families.input_images import InputImages
    from tasks.common.families.latent_codec import LatentCodec
    from tasks.common.families.text_conditioner import TextConditioner

    members = {k for k in (*vars(ModelFamily), *ModelFamily.__annotations__) if not k.startswith("_")}
    assert len(members) <= MAX_FAMILY_MEMBERS, sorted(members)
    for family in families.FAMILIES:
        assert isinstance(family.export, ExportProfile) and family.export.title == family.title
        assert isinstance(family.codec, LatentCodec) and family.codec.pixel_multiple % 8 == 0
        assert isinstance(family.text, TextConditioner) and family.text.title == family.title
        assert isinstance(family.denoiser, Denoiser) and family.denoiser.title == family.title
        assert isinstance(family.inputs, InputImages) and family.inputs.title == family.title
        assert family.inputs.least <= family.inputs.most and (family.inputs.most or not family.inputs.trains)
        assert set(family.text.trainable or ()) <= set(family.text.encoder_names)
        refusal = family.export.single_file_refusal({"_class_name": family.pipeline.names[0],
                                                     "text_encoder": ["transformers", "CLIPTextModel"]})
        assert refusal is None or family.title in refusal
    from tasks.common.families.flow import FlowDenoiser, FlowMatchingFamily

    # a flow-matching family that sets no denoiser of its own still trains by flow matching
    flow = FlowMatchingFamily.denoiser
    assert isinstance(flow, FlowDenoiser) and flow.objective == "flow_matching" and not flow.xla_tested


def test_an_unknown_pipeline_is_refused_naming_the_supported_ones() -> None:
    with pytest.raises(UserError, match="KandinskyPipeline.*not supported.*FLUX.1"):
        families.from_index({"_class_name": "KandinskyPipeline"}, "base.model")


@pytest.mark.parametrize("kind", ["builtin:tiny-sd3", "builtin:tiny-flux", "builtin:tiny-flux2",
                                  "builtin:tiny-zimage", "builtin:tiny-sana"])
def test_conditioning_has_the_pipelines_layout(tmp_path, kind) -> None:
    """Training's prompt encoding equals the pipeline's own encode_prompt (SD3: CLIP-L|CLIP-G padded,
    then T5; FLUX: T5's sequence, CLIP's pooled output; FLUX.2 klein: Qwen3's layers 9, 18, 27 of the
    chat-templated prompt, nothing pooled; Z-Image: Qwen3's second-to-last layer, each prompt's own
    tokens, with the mask that cuts them; Sana: Gemma-2's last hidden state of the lowercased prompt
    padded on the right, its attention mask where the pooled output goes), for a batch of prompts of
    different lengths (Qwen-Image: test_masked_conditioning_is_the_pipelines)."""
    path = families.build_tiny_pipeline(kind, 0, tmp_path)
    family = families.detect(path)
    components = family.load_components(path)
    prompts = ["a photo of sks toy", "a red cube on the beach"]
    ids = family.text.tokenize(components, prompts, max_sequence_length=32)
    more = [prompts] * (len(family.text.encoder_names) - 1)  # prompt_2 (, prompt_3)
    with torch.no_grad():
        hidden, pooled = family.text.encode_prompt(components, ids)
        pipe = family.pipeline.diffusers_class().from_pretrained(path)
        extra = {"do_classifier_free_guidance": False} if family.name in ("sd3", "zimage", "sana") else {}
        out = pipe.encode_prompt(prompts, *more, max_sequence_length=32, **extra)
    if family.name == "zimage":  # one tensor per prompt, its own length: the mask cuts the padded rows
        rows = [row[keep.bool()] for row, keep in zip(hidden, pooled)]
        assert [r.shape for r in rows] == [r.shape for r in out[0]] and len({r.shape[0] for r in rows}) == 2
        assert all(torch.allclose(r, ref, atol=1e-5) for r, ref in zip(rows, out[0]))
        return
    pooled_at = {"sd3": 2, "flux": 1, "flux2": None, "sana": 1}[family.name]  # where encode_prompt returns it
    ref, ref_pooled = out[0], None if pooled_at is None else out[pooled_at]
    assert hidden.shape == ref.shape and torch.allclose(hidden, ref, atol=1e-5)
    assert (pooled is None) if ref_pooled is None else torch.allclose(pooled, ref_pooled.to(pooled.dtype), atol=1e-5)
    if family.name == "sana":  # a mask: the shorter prompt's tail is padding
        assert 0 < pooled[0].sum() < pooled[1].sum() and pooled[:, -1].sum() == 0


@pytest.fixture(scope="module")
def tiny_qwenimage(tmp_path_factory):
    return families.build_tiny_pipeline("builtin:tiny-qwenimage", 0, tmp_path_factory.mktemp("qwenimage"))


def test_masked_conditioning_is_the_pipelines(tiny_qwenimage) -> None:
    """Qwen-Image: training's prompts are padded to max_sequence_length with their mask in the pooled slot;
    cut to the pipeline's length they equal its encode_prompt (system turn dropped, each prompt its own
    length), and the transformer predicts the same through the padding as on the pipeline's embeddings."""
    from diffusers import QwenImagePipeline

    path = tiny_qwenimage
    family = families.detect(path)
    components = family.load_components(path)
    prompts = ["a photo of sks toy", "a red cube on the beach"]
    with torch.no_grad():
        ids = family.text.tokenize(components, prompts, max_sequence_length=32)
        hidden, mask = family.text.encode_prompt(components, ids)
        pipe = QwenImagePipeline.from_pretrained(path)
        ref, ref_mask = pipe.encode_prompt(prompts, max_sequence_length=32)
        n = ref.shape[1]
        assert hidden.shape == (2, 32, ref.shape[2]) and mask.dtype == hidden.dtype
        assert torch.allclose(hidden[:, :n], ref, atol=1e-5) and not hidden[:, n:].any()
        assert torch.equal(mask[:, :n], ref_mask.to(mask.dtype)) and not mask[:, n:].any()
        assert ref_mask.sum(1).tolist()[0] < n  # the first prompt is shorter: padded in both
        system = pipe.prompt_template_encode.split("{}")[0]  # the turn the pipeline drops, as Qwen's tokens
        assert len(pipe.tokenizer(system).input_ids) == pipe.prompt_template_encode_start_idx == 34
        turns = [{"role": "system", "content": system.split("\n", 1)[1].split("<|im_end|>")[0]},
                 {"role": "user", "content": prompts[0]}]  # its chat template renders the pipeline's template
        assert pipe.tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True) \
            == pipe.prompt_template_encode.format(prompts[0])
        latents = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
        t = torch.tensor([500.0, 250.0])
        pred = family.denoiser.predict(components.denoiser, latents, t, hidden, mask, None)
        packed = QwenImagePipeline._pack_latents(latents, 2, 4, 8, 8)
        direct = components.denoiser(hidden_states=packed, timestep=t / 1000, encoder_hidden_states=ref,
                                     encoder_hidden_states_mask=ref_mask, img_shapes=[[(1, 4, 4)]] * 2)[0]
    assert pred.shape == latents.shape
    assert torch.allclose(pred, QwenImagePipeline._unpack_latents(direct, 8, 8, 1)[:, :, 0], atol=1e-5)


def test_a_guidance_value_runs_true_cfg(tiny_qwenimage) -> None:
    """Qwen-Image's pipeline guides (`true_cfg_scale`) only with a negative prompt: a call with guidance
    above 1 and none sends " " (the stages' guidance guides, a second transformer pass per step); a
    negative prompt given is kept, and guidance 1 or none leaves the pipeline unguided."""
    from finetune_runtime import pipeline_call

    family = families.by_name("qwenimage")
    convention = family.call_convention()
    args = pipeline_call.call_arguments(["a", "b"], convention, steps=1, guidance=4.0)
    assert args["true_cfg_scale"] == 4.0 and args["negative_prompt"] == [" ", " "]
    assert pipeline_call.call_arguments("a", convention, steps=1, guidance=4.0, negative="blur")["negative_prompt"] \
        == "blur"
    assert "negative_prompt" not in pipeline_call.call_arguments("a", convention, steps=1, guidance=1.0)
    pipe = family.pipeline.diffusers_class().from_pretrained(tiny_qwenimage)
    calls = []
    pipe.transformer.register_forward_hook(lambda *_: calls.append(1))
    for guidance, passes in ((4.0, 4), (1.0, 2), (None, 2)):
        calls.clear()
        family.generate(pipe, ["a photo of sks toy"], steps=2, height=32, width=32, guidance=guidance,
                        output_type="np")
        assert len(calls) == passes, (guidance, len(calls))


def test_a_hard_coded_pipeline_size_follows_the_vae(tmp_path) -> None:
    """Z-Image's pipeline makes 1024 px when given no size, whatever its VAE; the family's call makes
    its default latent side times the VAE's factor (1024 px for the real model, 256 for the tiny
    one), and the served model's default size (the same rule, from the recorded convention) says the same."""
    from finetune_runtime.convention import CallConvention
    from finetune_runtime.size import shape_of

    family = families.BUILTINS["builtin:tiny-zimage"]
    pipe = family.pipeline.diffusers_class().from_pretrained(families.build_tiny_pipeline(family.builtin, 0, tmp_path))
    assert pipe.vae_scale_factor == 2
    image = family.generate(pipe, "a photo of sks toy", steps=1, guidance=0.0)[0]
    assert image.size == (256, 256)
    recorded = CallConvention.from_config({"pipeline_call": family.call_convention().as_config()})
    assert shape_of(pipe, recorded).default == (256, 256)
    assert shape_of(pipe, CallConvention()).default == (512, 512)  # unrecorded: the denoiser's guess


def test_sana_generates_from_the_conditioning_it_trains_on(tmp_path) -> None:
    """What the transformer sees when the family generates (the call convention: no complex human
    instruction) is what training encodes, at the default 300 tokens; the pipeline's own default
    (the instruction before the prompt) is not."""
    family = families.BUILTINS["builtin:tiny-sana"]
    path = families.build_tiny_pipeline("builtin:tiny-sana", 0, tmp_path)
    pipe = family.pipeline.diffusers_class().from_pretrained(path)
    seen = []
    pipe.transformer.register_forward_pre_hook(
        lambda _m, _a, kw: seen.append((kw["encoder_hidden_states"][-1], kw["encoder_attention_mask"][-1])),
        with_kwargs=True)
    components = family.load_components(path)
    with torch.no_grad():
        hidden, mask = family.text.encode_prompt(components, family.text.tokenize(components, ["A photo of sks toy"]))
        latents = torch.randn(1, 4, 8, 8)
        family.generate(pipe, ["A photo of sks toy"], steps=1, height=32, width=32, latents=latents)
        pipe(prompt="A photo of sks toy", num_inference_steps=1, height=32, width=32, latents=latents)
    (ours, our_mask), (default, _) = seen
    assert hidden.shape[1] == 300 and torch.allclose(ours, hidden[0], atol=1e-5) and torch.equal(our_mask, mask[0])
    assert not torch.allclose(default, hidden[0], atol=1e-3)


def test_a_member_moved_into_a_role_is_refused_naming_the_role() -> None:
    """A family written before the denoiser role (its `lora_targets` a class member) would train with the
    default targets without a word; defining it is refused, naming where it went."""
    from tasks.common.families.sd import StableDiffusion

    with pytest.raises(TypeError, match="lora_targets is now denoiser.lora_targets; predict is now denoiser.predict"):
        type("OldStyle", (StableDiffusion,), {"lora_targets": ("to_q",), "predict": classmethod(lambda cls: None)})
    from tasks.common.families.flux import Flux

    with pytest.raises(TypeError, match="image_tokens is now denoiser.image_tokens"):  # a family's own helper too
        type("OldFlux", (Flux,), {"image_tokens": classmethod(lambda cls, latents, inputs: None)})
