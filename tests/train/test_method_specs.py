"""The method registry: every check asks a method's spec, never its name; a new method is one module.

The toy method (toy_method.py) is registered here and trains, validates and saves through the
shared loop with no other file changed."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from tasks.train import method_specs as methods

ROOT = Path(__file__).resolve().parents[2]
METHODS_DIR = ROOT / "tasks" / "train" / "methods"


def _names_in(node: ast.AST) -> set[str]:
    values = node.elts if isinstance(node, ast.Tuple | ast.List | ast.Set) else [node]
    return {v.value for v in values if isinstance(v, ast.Constant) and isinstance(v.value, str)}


def name_comparisons(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, name) of every comparison of something with a method name (==, !=, in, not in)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            for side in (node.left, *node.comparators):
                found += [(node.lineno, n) for n in sorted(_names_in(side) & names)]
    return found


@pytest.mark.quick
def test_no_method_name_is_compared_outside_its_own_module() -> None:
    names = set(methods.names())
    problems = [f"{path.relative_to(ROOT)}:{line}: {name!r}"
                for top in ("tasks", "flows") for path in sorted((ROOT / top).rglob("*.py"))
                if METHODS_DIR not in path.parents
                for line, name in name_comparisons(path.read_text(), names)]
    assert not problems, "method names compared as strings (ask tasks/train/method_specs/):\n" + "\n".join(problems)
    assert name_comparisons('if cfg.method == "lora" or m in ("full", "x"):\n    pass\n', names) == \
        [(1, "lora"), (1, "full")]


@pytest.mark.quick
def test_the_config_check_imports_no_torch() -> None:
    import subprocess

    code = ("import sys; from tasks.train.config import TrainConfig; TrainConfig(method='textual_inversion', "
            "placeholder_token='<t>', initializer_token='toy', with_prior_preservation=False); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


TRAINERS = "tasks.train.methods"


def _is_trainer(module: str) -> bool:
    return module.startswith(f"{TRAINERS}.")


@pytest.mark.quick
def test_imports_go_one_way_from_the_trainers_to_the_specs_and_the_config() -> None:
    """The specs and the config never import a trainer (a spec names its trainer by path); a trainer
    never imports a module that imports a trainer (read from the source, imports inside functions
    included)."""
    from tasks.common.stage_deps import closure, import_graph

    graph = import_graph(ROOT)
    starts = ["tasks.train.config", *sorted(m for m in graph if m.startswith("tasks.train.method_specs")),
              *sorted(m for m in graph if m.startswith("tasks.train.sections"))]
    reaches = {start: sorted(filter(_is_trainer, closure(graph, start, packages=False))) for start in starts}
    assert not {k: v for k, v in reaches.items() if v}, "the config or a spec imports a trainer"
    back = [f"{trainer} -> {module}" for trainer in filter(_is_trainer, graph)
            for module in closure(graph, trainer, packages=False) - {trainer}
            if not _is_trainer(module) and any(map(_is_trainer, closure(graph, module, packages=False)))]
    assert not back, "a trainer imports a module that imports a trainer:\n" + "\n".join(sorted(back))
    assert set(filter(_is_trainer, graph["tasks.train.core"])) <= {f"{TRAINERS}.base"}, \
        "core.py gets a method's trainer from its spec, not by importing it"


@pytest.mark.quick
def test_loading_the_config_imports_no_trainer_and_no_torch() -> None:
    import subprocess

    code = ("import sys; from tasks.train import method_specs; from tasks.train.config import TrainConfig; "
            "TrainConfig(method='lora', rank=8); "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('tasks.train.methods')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.quick
def test_a_method_s_options_live_in_its_own_spec_and_nowhere_else() -> None:
    """TrainConfig is the shared sections (tasks/train/sections/: keys every method reads) plus one
    options model per method with options, declared in that method's spec module."""
    from tasks.train.config import TrainConfig

    lora, ti = methods.method_spec("lora"), methods.method_spec("textual_inversion")
    assert {"rank", "lora_type", "lora_format", "decompose_factor"} <= set(lora.options)
    assert {"placeholder_token", "initializer_token", "num_vectors"} <= set(ti.options)
    assert methods.method_spec("dreambooth").options == ()
    owners = {spec.options_model: spec for spec in methods.BUILTIN if spec.options_model}
    owned = {key for spec in owners.values() for key in spec.options}
    for base in TrainConfig.__bases__:
        if base in owners:
            assert base.__module__ == f"tasks.train.method_specs.{owners[base].name}", base
        else:
            assert base.__module__.startswith("tasks.train.sections."), base
            assert not owned & set(base.model_fields), f"{base.__name__} holds a method's option"
    assert set(owners) <= set(TrainConfig.__bases__)


@pytest.mark.quick
def test_a_method_with_options_registers_before_the_config_and_owns_its_keys(monkeypatch) -> None:
    from pydantic import Field

    from tasks.common.config import StageConfig
    from tasks.train.config import TrainConfig  # noqa: F401  (built: its keys are fixed)

    class BitFitOptions(StageConfig):
        bias_only: bool = Field(True, description="train the biases only")

    late = methods.MethodSpec(name="late", trains="weights", output="pipeline", trainer="x:Y",
                              options_model=BitFitOptions)
    with pytest.raises(ValueError, match="register the method before that import"):
        methods.register(late)
    assert "late" not in methods.names()

    class RankToo(StageConfig):
        rank: int = 8

    monkeypatch.setattr(methods, "_BUILT", None)  # as before tasks.train.config is imported
    methods.register(methods.MethodSpec(name="clash", trains="adapters", output="adapters", trainer="x:Y",
                                        options_model=RankToo))
    try:
        with pytest.raises(ValueError, match="train.rank is declared by both LoRAOptions and RankToo"):
            methods.options_models()
    finally:
        methods.unregister("clash")


@pytest.mark.quick
def test_the_spec_refuses_for_the_family_and_the_precision() -> None:
    from tasks.common import families
    from tasks.train.config import TrainConfig

    ti = methods.method_spec("textual_inversion")
    flux = families.by_name("flux")
    assert methods.family_refusal(ti, families.by_name("sd")) is None
    assert "textual_inversion is not available for FLUX.1" in methods.family_refusal(ti, flux)
    assert "textual_inversion" not in methods.names_for(flux)
    with pytest.raises(ValueError, match="method dreambooth updates the base's own weights"):
        TrainConfig(method="dreambooth", base_model_precision="int8")
    with pytest.raises(ValueError, match="unknown method 'dreambooht'; choose one of dreambooth"):
        TrainConfig(method="dreambooht")


def test_a_method_from_one_module_trains_validates_and_saves(tmp_path, tiny_sd, one_image) -> None:
    import torch
    from safetensors.torch import load_file

    from tasks.train.config import TrainConfig
    from tasks.train.core import train
    from tests.train.toy_method import SPEC

    methods.register(SPEC)
    try:
        cfg = TrainConfig(method=SPEC.name, max_train_steps=2, train_batch_size=1, resolution=32,
                          learning_rate=1e-2, num_validation_images=1, validation_inference_steps=2,
                          with_prior_preservation=False, checkpoints_dir=tmp_path / "ckpt", checkpointing_steps=1000)
        outcome = train(cfg, tiny_sd, one_image, None, tmp_path / "out")
    finally:
        methods.unregister(SPEC.name)
    assert outcome.method == SPEC.name and len(outcome.history) == 2
    unet = "unet/diffusion_pytorch_model.safetensors"
    before, after = load_file(tiny_sd / unet), load_file(tmp_path / "out" / unet)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.endswith(".bias") for k in changed), sorted(changed)[:5]
    assert outcome.validation, "validation images from the saved output"
    with pytest.raises(ValueError, match="unknown method 'bitfit'"):
        TrainConfig(method=SPEC.name)  # gone once unregistered


@pytest.mark.quick
def test_the_shared_config_reads_no_method_s_option() -> None:
    """The config and the shared sections ask the spec (`family_problem`, `base_precision_problem`)
    for a method's own refusals; none of them reads one of its options (`cfg.lora_format`)."""
    import ast

    options = {key for spec in methods.BUILTIN for key in spec.options}
    shared = [ROOT / "tasks/train/config.py", ROOT / "tasks/train/no_ops.py", ROOT / "tasks/train/concepts.py",
              *sorted((ROOT / "tasks/train/sections").glob("*.py"))]
    found = [f"{path.relative_to(ROOT)}:{node.lineno}: {node.attr}" for path in shared
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Attribute) and node.attr in options]
    assert not found, "a method's option read in shared code (give its spec a check):\n" + "\n".join(found)


@pytest.mark.quick
def test_a_method_s_own_family_and_precision_checks_live_on_its_spec() -> None:
    from types import SimpleNamespace

    from tasks.common import families
    from tasks.common.quantize import BasePrecision
    from tasks.train.config import TrainConfig

    lora, full = methods.method_spec("lora"), methods.method_spec("full")
    sana = families.by_name("sana")
    cfg = TrainConfig(method="lora", lora_format="comfyui")
    assert "train.lora_format: comfyui is not available for Sana" in lora.family_problem(cfg, sana)
    assert lora.family_problem(cfg, families.by_name("sd")) is None
    assert full.family_problem(TrainConfig(method="full"), sana) is None, "no check of its own: nothing refused"
    nf4 = BasePrecision.parse("nf4")
    assert "cannot train lora_type: lokr" in lora.base_precision_problem(SimpleNamespace(lora_type="lokr"), nf4)
    asked = []
    spec = methods.MethodSpec(name="probe", trains="adapters", output="adapters", trainer="x:Y",
                              base_precision_check=lambda c, p: asked.append((c, p)) or "no")
    assert spec.base_precision_problem("cfg", nf4) == "no" and asked == [("cfg", nf4)]
