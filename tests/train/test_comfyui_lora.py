"""`train.lora_format: comfyui`: the trained adapters as one file under ComfyUI's keys
(tasks/common/comfyui_lora.py), written by the LoRA method's own `save`.

- ComfyUI's own key maps (tests/train/comfyui_keymap.py, written down from its source at the commits
  named there): every key of the file, for every family ComfyUI has a model for and every adapter
  type, is one its LoraLoader maps and reads (none it would log as "lora key not loaded"); Sana,
  which ComfyUI has no model for, is refused before any model loads, naming the formats that work.
- Where diffusers has a converter for the family's ComfyUI keys (SD and SDXL: kohya's `lora_unet_`,
  `lora_te*_`; FLUX.1: OneTrainer's `lora_transformer_`; FLUX.2: kohya's `lora_unet_` with BFL's
  names, q, k and v fused; Z-Image and Qwen-Image: `diffusion_model.`), `pipe.load_lora_weights`
  on the ComfyUI file generates the same latents, bit for bit, as on diffusers' own file.
- Where it has none (SD3's `lora_transformer_`, `lycoris_` for LoKr and LoHa on the DiT families,
  DoRA's `dora_scale`, which diffusers' loaders drop), every key stem is checked against the module
  names and weight shapes of the real model, and the update ComfyUI computes from the file against peft's.
- LoKr, LoHa (and DoRA) load with the LyCORIS library (kohya's network and its own) to the same
  per-layer weight deltas (merged weights) as peft's.
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tasks.common import adapter_formats, families
from tasks.common.adapters import TYPES as ADAPTERS
from tasks.common.adapters import peft_config
from tasks.common.comfyui_lora import COMFYUI_LORA_NAME, SUFFIXES, comfyui_state, prefixes, stem
from tasks.common.errors import UserError
from tasks.train.config import TrainConfig
from tasks.train.methods.lora import WEIGHT_NAME, LoRA
from tests.train import comfyui_keymap


def adapted(base: Path, lora_type: str, text: bool = False, rank: int = 4, alpha: float | None = None,
            seed: int = 0) -> tuple[object, dict[str, torch.nn.Module]]:
    """The tiny pipeline with peft adapters (as the LoRA method adds them) on its denoiser (and its
    trainable text encoders), every adapter weight random (a trained adapter, not peft's zero init)."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(base)
    return pipe, with_adapters(pipe, lora_type, text, rank, alpha, seed)


def with_adapters(pipe: object, lora_type: str, text: bool = False, rank: int = 4, alpha: float | None = None,
                  seed: int = 0, copy: bool = False) -> dict[str, torch.nn.Module]:
    """`adapted`'s adapters on `pipe`'s modules (with `copy`: on copies of them, `pipe` unchanged)."""
    import copy as copying

    family = families.of_pipeline(pipe)
    names = {family.denoiser.name: family.denoiser.lora_targets}
    if text:
        names.update({n: family.text.lora_targets for n in family.text.trainable or family.text.encoder_names})
    generator = torch.Generator().manual_seed(seed)
    trained = {}
    for name, targets in names.items():
        module = copying.deepcopy(getattr(pipe, name)) if copy else getattr(pipe, name)
        module.add_adapter(peft_config(lora_type, rank, alpha, 0.0, list(targets)))
        for pname, param in module.named_parameters():
            if "lora_" in pname or "hada_" in pname or "lokr_" in pname:
                param.data = torch.randn(param.shape, generator=generator) * 0.1 + (1.0 if "magnitude" in pname else 0)
        trained[name] = module
    return trained


def save(tmp_path: Path, pipe: object, trained: dict, lora_type: str, **kw) -> Path:
    """The LoRA method's `save` with lora_format: comfyui, into a fresh folder."""
    method = LoRA(TrainConfig(method="lora", lora_type=lora_type, lora_format="comfyui", **{"rank": 4, **kw}))
    method._components = SimpleNamespace(family=families.of_pipeline(pipe))
    out = tmp_path / f"out-{lora_type}"
    out.mkdir(parents=True)
    method.save(Path("unused"), out, trained)
    return out


def transformers5_clip_names(state: dict, pipe: object) -> dict:
    """The ComfyUI file's CLIP keys as diffusers 0.40 must see them to find the layers of
    transformers 5's CLIPTextModel, which has no `text_model` level (CLIPTextModelWithProjection
    keeps it): a kohya file from any trainer has it, and ComfyUI maps
    `lora_te_text_model_encoder_layers_<n>_...`. Nothing else changes."""
    flat = {p for p, name in (("lora_te_", "text_encoder"), ("lora_te1_", "text_encoder"),
                              ("lora_te2_", "text_encoder_2")) if not hasattr(getattr(pipe, name, None), "text_model")}
    return {k.replace("_text_model_encoder_", "_encoder_", 1) if k.startswith(tuple(flat)) else k: v
            for k, v in state.items()}


def latents(base: Path, lora: Path | dict | None) -> torch.Tensor:
    """Two denoising steps of the base with the adapters loaded by diffusers' own loader."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(base)
    if isinstance(lora, Path):
        pipe.load_lora_weights(lora.parent, weight_name=lora.name)
    elif lora is not None:
        pipe.load_lora_weights(lora)
    family = families.of_pipeline(pipe)
    return family.generate(pipe, "a photo", steps=2, height=32, width=32, output_type="latent",
                           generator=torch.Generator().manual_seed(0))[0]


@pytest.mark.parametrize(("name", "lora_type", "text"), [
    ("sd", "lora", True), ("sdxl", "lora", True), ("flux", "lora", False), ("flux2", "lora", False),
    ("zimage", "lora", False), ("qwenimage", "lora", False)])
def test_diffusers_loads_the_comfyui_file_to_the_same_images(tmp_path, request, name, lora_type, text) -> None:
    base = request.getfixturevalue(f"tiny_{name}")
    pipe, trained = adapted(base, lora_type, text)
    out = save(tmp_path, pipe, trained, lora_type, train_text_encoder=text)
    comfy = load_file(out / COMFYUI_LORA_NAME)
    family = families.of_pipeline(pipe)
    assert {k.split(".")[0].split("_")[0] for k in comfy} <= {p.split(".")[0].split("_")[0] for p in
                                                              prefixes(family, lora_type).values()}
    if text:
        assert {k.split("_")[1] for k in comfy if k.startswith("lora_te")} == {
            p.split("_")[1] for n, p in prefixes(family, lora_type).items() if n.startswith("text_encoder")}
        assert all("_text_model_encoder_layers_" in k for k in comfy if k.startswith("lora_te")), "ComfyUI's names"
        assert any(k.startswith("lora_te") for k in comfy)
    plain = latents(base, None)
    ours, theirs = latents(base, out / WEIGHT_NAME), latents(base, transformers5_clip_names(comfy, pipe))
    assert not torch.equal(plain, ours), "the adapters change the images"
    assert torch.equal(ours, theirs)


def layer_stems(pipe: object, trained: dict, lora_type: str) -> dict[str, object]:
    """ComfyUI's stem of every peft layer in `trained` -> that layer."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    names = prefixes(families.of_pipeline(pipe), lora_type)
    return {stem(names[c], path): layer for c, module in trained.items()
            for path, layer in module.named_modules() if isinstance(layer, BaseTunerLayer)}


def grouped(state: dict) -> dict[str, dict[str, torch.Tensor]]:
    """The file's tensors by key stem: {stem: {suffix: tensor}}."""
    layers: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        suffix = next(s for s in (*SUFFIXES.values(), "alpha") if key.endswith("." + s))
        layers.setdefault(key[: -len(suffix) - 1], {})[suffix] = tensor
    return layers


def full_delta(t: dict[str, torch.Tensor]) -> torch.Tensor:
    """The weight update ComfyUI computes from one layer's tensors (comfy/weight_adapter: LoRA, LoHa, LoKr)."""
    if "lora_down.weight" in t:
        return t["lora_up.weight"] @ t["lora_down.weight"] * (t["alpha"] / t["lora_down.weight"].shape[0])
    if "hada_w1_a" in t:
        w = (t["hada_w1_a"] @ t["hada_w1_b"]) * (t["hada_w2_a"] @ t["hada_w2_b"])
        return w * (t["alpha"] / t["hada_w1_b"].shape[0])
    w1 = t["lokr_w1"] if "lokr_w1" in t else t["lokr_w1_a"] @ t["lokr_w1_b"]
    w2 = t["lokr_w2"] if "lokr_w2" in t else t["lokr_w2_a"] @ t["lokr_w2_b"]
    low = t.get("lokr_w2_b", t.get("lokr_w1_b"))
    return torch.kron(w1, w2) * (t["alpha"] / low.shape[0] if low is not None else 1.0)


#: ComfyUI's key prefixes (comfy/lora.py's key maps) and the pipeline component each one names
COMFYUI_PREFIXES = {"lora_unet_": "unet", "lora_te_": "text_encoder", "lora_te1_": "text_encoder",
                    "lora_te2_": "text_encoder_2", "lora_transformer_": "transformer", "lycoris_": "transformer",
                    "diffusion_model.": "transformer"}


def base_weight(base: object, key: str) -> torch.Tensor:
    """The weight of the base model's module a ComfyUI key stem names, found by its module names as
    ComfyUI's key map is built: kohya stems are the path with "_" for "." (CLIP's under the original
    checkpoints' `text_model.`), `diffusion_model.` stems the dotted path."""
    prefix = next(p for p in COMFYUI_PREFIXES if key.startswith(p))
    model, rest = getattr(base, COMFYUI_PREFIXES[prefix]), key[len(prefix):]
    if prefix.endswith("."):
        return model.get_submodule(rest).weight
    names = {("text_model." if prefix.startswith("lora_te") and not n.startswith("text_model.") else "")
             + n: m for n, m in model.named_modules()}
    (found,) = [m for n, m in names.items() if n.replace(".", "_") == rest]
    return found.weight


# LoKr at rank 4 on the tiny models: two full Kronecker factors (peft's scale folded into lokr_w1);
# at rank 1: lokr_w2 low-rank (lokr_w2_a, lokr_w2_b) with alpha.
@pytest.mark.parametrize(("name", "lora_type", "text", "rank"), [
    ("sd3", "lora", True, 4), ("sd3", "loha", False, 4), ("flux", "lokr", True, 4), ("flux", "dora", True, 4),
    ("flux2", "loha", False, 4), ("zimage", "lokr", False, 1), ("zimage", "loha", False, 4),
    ("qwenimage", "lokr", False, 1), ("sdxl", "lokr", True, 4), ("sd", "loha", True, 4)])
def test_every_key_names_a_layer_of_the_real_model_with_the_update_peft_applies(tmp_path, request, name, lora_type,
                                                                                  text, rank) -> None:
    """ComfyUI's key map is built from the model's module names: each stem of the file names a module
    of the base model with a weight of the update's shape, and the update ComfyUI's formulas give
    from the file's tensors is peft's own `get_delta_weight` for that layer (alpha, factors, scale)."""
    base = request.getfixturevalue(f"tiny_{name}")
    pipe, trained = adapted(base, lora_type, text, rank=rank, alpha=8.0)
    out = save(tmp_path, pipe, trained, lora_type, train_text_encoder=text, rank=rank, lora_alpha=8.0)
    layers = grouped(load_file(out / COMFYUI_LORA_NAME))
    peft_layers = layer_stems(pipe, trained, lora_type)
    assert set(layers) == set(peft_layers), "one stem per adapted layer"
    from diffusers import DiffusionPipeline

    plain = DiffusionPipeline.from_pretrained(base)
    for key, tensors in layers.items():
        expected = peft_layers[key].get_delta_weight("default")
        assert base_weight(plain, key).shape == expected.shape, key
        if lora_type == "dora":
            assert tensors["dora_scale"].shape == (expected.shape[0], 1)
            expected = peft_layers[key].lora_B["default"].weight @ peft_layers[key].lora_A["default"].weight \
                * peft_layers[key].scaling["default"]
        assert torch.allclose(full_delta(tensors), expected, rtol=1e-5, atol=1e-6), key


def lycoris_network(file: Path, base: Path) -> tuple[object, list]:
    """The file loaded by LyCORIS onto a fresh base: kohya's network (`lora_unet_`) for SD and SDXL's
    UNet, its own (`lycoris_`) for the DiT families' transformer."""
    from diffusers import DiffusionPipeline
    from lycoris import create_lycoris_from_weights
    from lycoris.kohya import create_network_from_weights

    pipe = DiffusionPipeline.from_pretrained(base)
    if hasattr(pipe, "unet"):
        network, _ = create_network_from_weights(1.0, str(file), pipe.vae, None, pipe.unet)
        return pipe, network.unet_loras
    network, _ = create_lycoris_from_weights(1.0, str(file), pipe.transformer)
    return pipe, network.loras


@pytest.mark.parametrize(("name", "lora_type", "rank"), [
    ("sd", "loha", 4), ("sd", "lokr", 4), ("sdxl", "lokr", 1), ("flux", "loha", 4), ("flux", "lokr", 1),
    ("zimage", "lokr", 4), ("sd3", "loha", 2)])
def test_lycoris_loads_lokr_and_loha_to_peft_s_weight_deltas(tmp_path, request, name, lora_type, rank) -> None:
    base = request.getfixturevalue(f"tiny_{name}")
    pipe, trained = adapted(base, lora_type, rank=rank, alpha=2.0)
    out = save(tmp_path, pipe, trained, lora_type, rank=rank, lora_alpha=2.0)
    _, modules = lycoris_network(out / COMFYUI_LORA_NAME, base)
    peft_layers = layer_stems(pipe, trained, lora_type)
    assert {m.lora_name for m in modules} == set(peft_layers), "LyCORIS finds every layer"
    assert {type(m).__name__ for m in modules} == {"lokr": {"LokrModule"}, "loha": {"LohaModule"}}[lora_type]
    x = torch.randn(3, modules[0].org_module[0].in_features, generator=torch.Generator().manual_seed(1))
    for module in modules:
        layer = peft_layers[module.lora_name].eval()
        # What LyCORIS' forward adds to the layer's weight (get_weight; 3.2.0's get_diff_weight, used
        # by its merge, applies the alpha / rank scale a second time).
        delta = module.get_weight(module.shape) * module.scalar
        assert torch.allclose(delta, layer.get_delta_weight("default"), rtol=1e-5, atol=1e-7), module.lora_name
        if module.org_module[0].in_features == x.shape[1]:
            assert torch.allclose(module.eval()(x), layer(x), rtol=1e-5, atol=1e-6), module.lora_name


def test_dora_loads_in_lycoris_to_peft_s_merged_weights(tmp_path, tiny_sd) -> None:
    """diffusers' loaders drop `dora_scale` (0.40: "not compatible in Diffusers"); LyCORIS' LoCon
    with weight decomposition reads it (kohya's output-axis (out, 1) magnitude) and merges each
    layer to peft's DoRA weight."""
    pipe, trained = adapted(tiny_sd, "dora")
    out = save(tmp_path, pipe, trained, "dora")
    _, modules = lycoris_network(out / COMFYUI_LORA_NAME, tiny_sd)
    peft_layers = layer_stems(pipe, trained, "dora")
    assert {m.lora_name for m in modules} == set(peft_layers) and all(m.wd for m in modules)
    for module in modules:
        layer = peft_layers[module.lora_name]
        base_weight_before = layer.get_base_layer().weight.detach().clone()
        layer.merge(adapter_names=["default"])
        merged, layer.get_base_layer().weight.data = layer.get_base_layer().weight.detach().clone(), base_weight_before
        layer.merged_adapters.clear()
        assert torch.allclose(module.get_merged_weight()[0], merged, rtol=1e-5, atol=1e-6), module.lora_name


@pytest.mark.parametrize(("lora_type", "module", "args"), [
    ("lora", "networks.lora", None), ("dora", "networks.lora", {"dora_wd": True}),
    ("lokr", "lycoris.kohya", {"algo": "lokr"}), ("loha", "lycoris.kohya", {"algo": "loha"})])
def test_kohya_metadata_and_sd_key_names(tmp_path, tiny_sd, lora_type, module, args) -> None:
    """kohya's network metadata (ss_network_module/dim/alpha/args) and the family; SD's UNet and
    CLIP layers under kohya's names, as ComfyUI's key maps list them."""
    pipe, trained = adapted(tiny_sd, lora_type, text=True, rank=2, alpha=4.0)
    out = save(tmp_path, pipe, trained, lora_type, train_text_encoder=True, rank=2, lora_alpha=4.0)
    with safe_open(out / COMFYUI_LORA_NAME, "pt") as fh:
        meta, keys = fh.metadata(), set(fh.keys())
    assert meta["ss_network_module"] == module and meta["ss_network_dim"] == "2"
    assert meta["ss_network_alpha"] == "4.0" and meta["ss_base_model_version"] == "sd"
    assert (json.loads(meta["ss_network_args"]) if "ss_network_args" in meta else None) == args
    first = {"lora": "lora_down.weight", "dora": "dora_scale", "lokr": "lokr_w1", "loha": "hada_w1_a"}[lora_type]
    assert f"lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn1_to_q.{first}" in keys
    assert f"lora_te_text_model_encoder_layers_0_self_attn_q_proj.{first}" in keys
    assert "lora_te_text_model_encoder_layers_0_self_attn_q_proj.alpha" in keys


def test_the_default_format_writes_no_comfyui_file_and_other_methods_refuse_the_key(tmp_path, tiny_sd) -> None:
    pipe, trained = adapted(tiny_sd, "lora")
    method = LoRA(TrainConfig(method="lora", rank=4))
    method._components = SimpleNamespace(family=families.of_pipeline(pipe))
    method.save(Path("unused"), tmp_path, trained)
    assert (tmp_path / WEIGHT_NAME).is_file() and not (tmp_path / COMFYUI_LORA_NAME).exists()
    with pytest.raises(ValueError, match="lora_format is set .* only method: lora reads it"):
        TrainConfig(method="dreambooth", lora_format="comfyui")
    with pytest.raises(ValueError, match="lora_format"):
        TrainConfig(method="lora", lora_format="kohya")


@pytest.mark.parametrize("lora_type", ["lora", "dora"])
def test_flux2_fuses_q_k_v_into_bfl_qkv_exactly(tmp_path, tiny_flux2, lora_type) -> None:
    """ComfyUI's FLUX.2 has one `qkv` weight per double-stream block: the file's fused layer gives
    it the three peft updates stacked (and DoRA's three magnitudes), every other layer under BFL's name."""
    pipe, trained = adapted(tiny_flux2, lora_type, alpha=8.0)
    out = save(tmp_path, pipe, trained, lora_type, lora_alpha=8.0)
    layers = grouped(load_file(out / COMFYUI_LORA_NAME))
    peft = {path: layer for path, layer in trained["transformer"].named_modules() if hasattr(layer, "lora_A")}
    attn = "transformer_blocks.0.attn"
    qkv = layers["lora_unet_double_blocks_0_img_attn_qkv"]
    parts = [peft[f"{attn}.to_{x}"] for x in "qkv"]
    assert torch.allclose(full_delta(qkv), torch.cat([p.get_delta_weight("default") for p in parts]), atol=1e-7)
    if lora_type == "dora":
        assert torch.equal(qkv["dora_scale"][:, 0], torch.cat([p.lora_magnitude_vector["default"].weight
                                                               for p in parts]))
    renamed = {"lora_unet_double_blocks_0_img_attn_proj": f"{attn}.to_out.0",
               "lora_unet_single_blocks_0_linear1": "single_transformer_blocks.0.attn.to_qkv_mlp_proj",
               "lora_unet_single_blocks_0_linear2": "single_transformer_blocks.0.attn.to_out"}
    for key, path in renamed.items():
        assert torch.allclose(full_delta(layers[key]), peft[path].get_delta_weight("default"), atol=1e-7), key
    assert len(layers) == len(peft) - 2 * sum(k.endswith("attn.to_q") for k in peft), "q, k, v: one layer each block"


def test_the_train_stage_writes_the_comfyui_file_beside_its_outputs(tmp_path, tiny_sd, one_image) -> None:
    """One real training step (the stage's `train`): the ComfyUI file beside peft's LoHa folders,
    every trained layer in it, and the report saying so."""
    from tasks.train.core import train

    config = TrainConfig(method="lora", lora_type="loha", lora_format="comfyui", rank=2, max_train_steps=1,
                         train_batch_size=1, resolution=32, num_validation_images=0, fuse_lora=False,
                         with_prior_preservation=False, checkpoints_dir=tmp_path / "ckpt")
    outcome = train(config, tiny_sd, one_image, None, tmp_path / "out")
    assert outcome.report()["lora_format"] == "comfyui"
    assert (tmp_path / "out" / "peft_adapters" / "unet").is_dir()
    layers = grouped(load_file(tmp_path / "out" / COMFYUI_LORA_NAME))
    _, modules = lycoris_network(tmp_path / "out" / COMFYUI_LORA_NAME, tiny_sd)
    assert len(modules) == len(layers) > 0 and all(k.startswith("lora_unet_") for k in layers)


#: the families ComfyUI has a model for (its key maps, tests/train/comfyui_keymap.py), and Sana, which it has none for
COMFYUI_FAMILIES = [name for name, model in comfyui_keymap.COMFYUI_MODELS.items() if model is not None]


@pytest.mark.parametrize("name", COMFYUI_FAMILIES)  # not quick: every family's tiny model, five adapters each
def test_comfyui_maps_and_reads_every_key_of_the_file(name) -> None:
    """Every key the writer produces (the state dict `write_comfyui_lora` saves), for each adapter type
    (LoKr with whole and with low-rank factors) and with the family's trainable text encoders, is one
    ComfyUI's LoraLoader maps to a weight and reads as part of a whole layer: none it would log as
    "lora key not loaded"."""
    family = families.by_name(name)
    pipe = family.build_tiny(0)
    stems = comfyui_keymap.key_map(family, pipe)
    text = family.text.trainable != ()
    for lora_type, rank in (*((t, 4) for t in ADAPTERS.names()), ("lokr", 1)):
        keys = set(comfyui_state(family, with_adapters(pipe, lora_type, text, rank=rank, copy=True), lora_type))
        assert keys, (lora_type, rank)
        assert not comfyui_keymap.not_loaded(keys, stems), (lora_type, rank)
        assert not text or any(k.startswith("lora_te") for k in keys), "the text encoders' layers are in it"


@pytest.mark.quick
def test_the_key_map_check_names_what_comfyui_would_not_load() -> None:
    """Not vacuous: names ComfyUI does not map, and layers it cannot read whole, are reported."""
    sd = families.by_name("sd")
    stems = comfyui_keymap.key_map(sd, sd.build_tiny(0))
    layer = "lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn1_to_q"
    good = [f"{layer}.lora_down.weight", f"{layer}.lora_up.weight", f"{layer}.alpha",
            "lora_te_text_model_encoder_layers_1_self_attn_out_proj.hada_w1_a",
            *(f"lora_te_text_model_encoder_layers_1_self_attn_out_proj.{n}" for n in ("hada_w1_b", "hada_w2_a",
                                                                                       "hada_w2_b"))]
    bad = ["lora_te_encoder_layers_0_self_attn_q_proj.lora_down.weight",  # transformers 5's name: no text_model
           "lora_te_encoder_layers_0_self_attn_q_proj.lora_up.weight",
           "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q.alpha",  # block 0 has no attention
           "diffusion_model.down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_k.lora_up.weight",
           "lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn1_to_k.lora_up.weight",  # no down
           "lora_te_text_model_encoder_layers_2_mlp_fc1.lora_down.weight",  # the tiny CLIP has 2 layers
           f"{layer}.lokr_w1"]  # a LoKr factor without its second
    assert comfyui_keymap.not_loaded(good, stems) == []
    assert comfyui_keymap.not_loaded(good + bad, stems) == sorted(bad)
    flux2 = families.by_name("flux2")
    stems = comfyui_keymap.key_map(flux2, flux2.build_tiny(0))
    assert {"lora_unet_single_blocks_0_linear1", "lycoris_single_transformer_blocks_0_attn_to_qkv_mlp_proj",
            "lora_unet_double_blocks_0_img_attn_qkv"} <= stems
    unmapped = {"lora_unet_single_transformer_blocks_0_attn_to_qkv_mlp_proj",
                "diffusion_model.double_blocks.0.img_attn.to_q", "lora_transformer_double_blocks_0_img_attn_qkv"}
    assert not unmapped & stems
    sana = families.by_name("sana")
    assert comfyui_keymap.key_map(sana, sana.build_tiny(0)) == set(), "ComfyUI has no Sana model"


@pytest.mark.quick
def test_comfyui_is_refused_up_front_for_a_family_comfyui_has_no_model_for() -> None:
    """One line naming the key, the family and the formats that work; the default works for every
    family, comfyui for every other."""
    sana = families.by_name("sana")
    with pytest.raises(UserError) as refused:
        TrainConfig(method="lora", lora_format="comfyui").check_family(sana)
    message = str(refused.value)
    assert "\n" not in message and "train.lora_format: comfyui is not available for Sana" in message
    assert message.endswith("choose one of diffusers") and "ComfyUI has no Sana model" in message
    assert adapter_formats.names_for(sana) == ["diffusers"]
    TrainConfig(method="lora").check_family(sana)
    for name in COMFYUI_FAMILIES:
        TrainConfig(method="lora", lora_format="comfyui", with_prior_preservation=False).check_family(
            families.by_name(name))
        assert adapter_formats.names_for(families.by_name(name)) == ["diffusers", "comfyui"]
    with pytest.raises(ValueError, match="unknown adapter format 'kohya'; choose one of diffusers, comfyui"):
        TrainConfig(method="lora", lora_format="kohya")


def test_the_train_stage_refuses_comfyui_for_sana_before_loading_a_model(tmp_path, tiny_sana, one_image,
                                                                          monkeypatch) -> None:
    from tasks.train import core

    monkeypatch.setattr(core, "_load_parts", lambda *a, **k: pytest.fail("a model was loaded"))
    config = TrainConfig(method="lora", lora_format="comfyui", max_train_steps=1, resolution=32,
                         checkpoints_dir=tmp_path / "ckpt")
    with pytest.raises(UserError, match=r"train\.lora_format: comfyui is not available for Sana"):
        core.train(config, tiny_sana, one_image, None, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.quick
def test_a_registered_format_is_accepted_and_its_file_written(tmp_path) -> None:
    """A new output format is one spec: the config accepts its name, the LoRA method writes its file,
    and a family it does not support is refused naming the others."""
    def write(path, family, modules, lora_type, rank, alpha) -> int:
        path.write_text(f"{family.name} {lora_type} {rank} {sorted(modules)}")
        return len(modules)

    toy = adapter_formats.AdapterFormat(name="toy", description="a test's format", file="toy.txt", writer=write,
                                        supports=lambda family: family.name != "sd3", unsupported="no {title} here")
    adapter_formats.register(toy)
    try:
        pipe = families.by_name("sd").build_tiny(0)
        method = LoRA(TrainConfig(method="lora", lora_format="toy", rank=2))
        method._components = SimpleNamespace(family=families.of_pipeline(pipe))
        method.save(Path("unused"), tmp_path, with_adapters(pipe, "lora", rank=2))
        assert (tmp_path / "toy.txt").read_text() == "sd lora 2 ['unet']"
        assert not (tmp_path / COMFYUI_LORA_NAME).exists()
        with pytest.raises(UserError, match=r"lora_format: toy is not available for .* \(no .* here\); "
                                            r"choose one of diffusers, comfyui$"):
            TrainConfig(method="lora", lora_format="toy").check_family(families.by_name("sd3"))
    finally:
        adapter_formats.unregister("toy")
    with pytest.raises(ValueError, match="toy"):
        TrainConfig(method="lora", lora_format="toy")
