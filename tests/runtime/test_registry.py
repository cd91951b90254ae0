"""One registry style (finetune_runtime/registry.py) for everything chosen by name: the registry's
own behaviour, and that families, methods, adapter types, adapter output formats and serving back
ends are each one `Registry`, reached through their modules' old functions."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from finetune_runtime.registry import Registry

pytestmark = pytest.mark.quick


@dataclass(frozen=True)
class Item:
    name: str
    size: int = 0


def test_records_keep_their_order_and_first_puts_one_in_front() -> None:
    reg = Registry("toy", (Item("a"), Item("b")))
    reg.register(Item("c"))
    assert reg.names() == ("a", "b", "c") and [i.name for i in reg] == ["a", "b", "c"] and len(reg) == 3
    reg.register(Item("z"), first=True)
    assert reg.names() == ("z", "a", "b", "c")
    reg.register(Item("b", 2))  # replaced where it stands
    assert reg.names() == ("z", "a", "b", "c") and reg.get("b").size == 2
    reg.register(Item("c", 3), first=True)  # replaced and moved first
    assert reg.names() == ("c", "z", "a", "b") and reg.items()[0] == Item("c", 3)
    assert reg.where(lambda i: i.size > 0) == (Item("c", 3), Item("b", 2))
    assert "a" in reg and "y" not in reg


def test_an_unknown_name_is_refused_naming_the_known_ones_and_unregister_removes() -> None:
    reg = Registry("adapter thing", (Item("a"), Item("b")))
    with pytest.raises(ValueError, match=r"^unknown adapter thing 'x'; choose one of a, b$"):
        reg.get("x")
    reg.unregister("a")
    reg.unregister("never")  # nothing to do
    assert reg.names() == ("b",)
    with pytest.raises(ValueError, match="choose one of b$"):
        reg.get("a")


def test_a_key_other_than_the_name_attribute() -> None:
    reg = Registry("class", (int, str), key=lambda c: c.__name__)
    assert reg.get("str") is str and reg.names() == ("int", "str")


def test_families_methods_adapter_types_formats_and_back_ends_are_each_a_registry() -> None:
    from finetune_runtime import load
    from tasks.common import adapter_formats, adapters, families
    from tasks.train import method_specs

    for registry in (families.REGISTRY, method_specs.SPECS, adapters.TYPES, adapter_formats.FORMATS, load.BACKENDS):
        assert isinstance(registry, Registry), registry
    assert families.REGISTRY.items() == families.FAMILIES
    assert families.by_name("sd") is families.REGISTRY.get("sd")
    assert method_specs.names() == method_specs.SPECS.names()
    assert adapter_formats.names() == adapter_formats.FORMATS.names() == ("diffusers", "comfyui")
    assert adapters.TYPES.names() == ("lora", "dora", "lokr", "loha")
    assert adapters.names_where(lambda t: t.diffusers_file) == ("lora", "dora")
    assert adapters.names_where(lambda t: t.runtime) == ("lora",)
    assert load.BACKENDS.names() == ("genai", "openvino", "diffusers")
    assert [b.name for b in load.BACKENDS if b.request_adapters] == ["genai"]
    with pytest.raises(ValueError, match="unknown serving back end 'onnx'; choose one of genai, openvino, diffusers"):
        load.BACKENDS.get("onnx")
    with pytest.raises(ValueError, match="unknown adapter type 'lycoris'; choose one of lora, dora, lokr, loha"):
        adapters.adapter_type("lycoris")


def test_families_and_builtins_follow_register_and_unregister() -> None:
    from tasks.common import families

    sd = families.by_name("sd")
    toy = type("ToyFamily", (sd,), {"name": "toy-registry", "builtin": "builtin:tiny-toy-registry"})
    families.register(toy, first=True)
    try:
        assert families.FAMILIES[0] is toy and families.BUILTINS["builtin:tiny-toy-registry"] is toy
        assert families.by_name("toy-registry") is toy
    finally:
        families.unregister("toy-registry")
    assert toy not in families.FAMILIES and "builtin:tiny-toy-registry" not in families.BUILTINS
    with pytest.raises(ValueError, match="unknown model family 'toy-registry'; choose one of sdxl"):
        families.by_name("toy-registry")


def test_a_new_adapter_type_is_one_record() -> None:
    from tasks.common import adapters
    from tasks.common.comfyui_lora import metadata, network_module

    made = []
    toy = adapters.AdapterType("toy", "Toy", lambda *args: made.append(args) or "config", lycoris=True,
                               network_args={"algo": "toy"})
    adapters.TYPES.register(toy)
    try:
        assert adapters.peft_config("toy", 4, None, 0.0, ["to_q"]) == "config" and made == [(4, 4, 0.0, ["to_q"], -1)]
        assert network_module("toy") == "lycoris.kohya" and "toy" in adapters.TYPES.names()
        sd = type("Fam", (), {"name": "sd"})
        assert metadata(sd, "toy", 4, None)["ss_network_args"] == '{"algo": "toy"}'
    finally:
        adapters.TYPES.unregister("toy")
    assert "toy" not in adapters.TYPES.names()
    with pytest.raises(ValueError, match="lora_type: 'toy' is not one of lora, dora, lokr, loha"):
        adapters.peft_config("toy", 4, None, 0.0, ["to_q"])
