"""The family seam, enforced: outside tasks/common/families/, no module under tasks/ or flows/ names a
model family; it asks the family (tasks/common/families/README.md).

What counts as naming a family, read from the code (comments and docstrings are prose and free):

- an identifier, attribute, keyword, parameter, definition or import named like a family's class
  (StableDiffusionXL, FlowMatchingFamily), its pipeline or OpenVINO class (FluxPipeline,
  OVStableDiffusion3Pipeline), a component not every family has (unet, transformer, text_encoder_2,
  tokenizer_3), an attribute only some families define (temporal_compression), or one of
  EXPLICIT; or an import of a family's own module (tasks.common.families.sdxl);
- a string that is one of those names, a family id (sd, sdxl, sd3, flux, flux2) or an embedding key
  (clip_l), or holds such a name as a word where the name cannot be an English word (it has a digit,
  an underscore or a capital: "text_encoder_2", "sd3", but "SDXL" or "transformer blocks" in a
  message are prose);
- an objective name (ddpm, flow_matching) or a built-in model id (builtin:tiny-sdxl) where code
  decides by it: compared, tested with `in`, a dict key, a match case, a startswith/endswith
  argument. As plain values they are free: an objective names itself (tasks/train/objectives.py),
  and a built-in id is a model id a user writes in params.yaml, like a hub id, so defaults, help
  and messages may show one (lookups go through families.BUILTINS);
- getattr/hasattr on a family (probing for what only some families define).

Every name is taken from the families package itself (FAMILIES and their classes), so a new family
extends the rule; EXPLICIT adds what the classes do not state. A test below runs the same reader over
tasks/common/families/ and requires it to find every name there, so the rule cannot pass by finding
nothing.
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path

import pytest

from tasks.common import families
from tasks.common.families import FAMILIES, ModelFamily

pytestmark = pytest.mark.quick  # make test-fast

ROOT = Path(__file__).resolve().parents[2]
FAMILIES_DIR = ROOT / "tasks" / "common" / "families"
SCANNED = ("tasks", "flows", "finetune_runtime")

#: Family-specific names the family classes do not state as attributes: the families' own model
#: classes and the denoiser call conventions only some families use.
EXPLICIT = frozenset({
    "UNet2DConditionModel", "SD3Transformer2DModel", "FluxTransformer2DModel", "Flux2Transformer2DModel",
    "AutoencoderKLFlux2", "added_cond_kwargs", "pooled_projections", "guidance_embeds",
    "QwenImageTransformer2DModel", "AutoencoderKLQwenImage", "encoder_hidden_states_mask", "img_shapes",
})

#: (file, name): a mention that is not a family, with why. Each must still occur (see below).
ALLOWED = {
    ("tasks/export/single_file.py", "sdxl"): "the original single-file layout named 'sdxl' (TEXT_LAYOUTS), "
                                             "which families/sdxl.py's single_file_layout answers",
}


def _family_classes() -> list[type[ModelFamily]]:
    return list(dict.fromkeys(c for f in FAMILIES for c in f.__mro__
                              if issubclass(c, ModelFamily) and c is not ModelFamily))


def _role_only() -> set[str]:
    """What only some families' roles have: fields and methods of a role's subclasses (T5's tokenizer
    folder, the Qwen3 chat template, LTX-Video's VAE factors) that the shared role class does not define."""
    found = set()
    for family in FAMILIES:
        for role in (family.text, family.export, family.codec, family.denoiser, family.inputs):
            base = next(c for c in reversed(type(role).__mro__) if is_dataclass(c))
            shared = set(vars(base)) | {f.name for f in fields(base)}
            own = {k for c in type(role).__mro__ if c is not base and issubclass(c, base) for k in vars(c)}
            found |= {k for k in own | {f.name for f in fields(role)} if not k.startswith("_") and k not in shared}
    return found


def _forbidden() -> dict[str, frozenset[str]]:
    classes = _family_classes()
    shared = set(ModelFamily.__annotations__) | set(vars(ModelFamily))
    # "tokenizer" and "processor" are the role's own words: a family loading its tokenizer through a
    # processor folder (Qwen-Image-Edit) makes neither one family's name; tokenizer_2, _3 stay
    roles = {"tokenizer", "processor"}
    parts = [{*f.text.encoder_names, *(set(f.text.tokenizer_names) - roles), f.denoiser.name} for f in FAMILIES]
    return {
        "family class": frozenset(c.__name__ for c in classes),
        "pipeline class": frozenset(n for f in FAMILIES for n in (*f.pipeline.names, f.export.ov_pipeline)
                                    if n is not None),
        "component": frozenset(set.union(*parts) - set.intersection(*parts)),
        "family-only attribute": frozenset({*(k for c in classes for k in vars(c)
                                              if not k.startswith("__") and k not in shared), *_role_only()}),
        "explicit": EXPLICIT,
        "family id": frozenset(f.name for f in FAMILIES),
        "embedding key": frozenset(k for f in FAMILIES for k in f.text.embedding_keys or ()),
        "objective": frozenset(f.denoiser.objective for f in FAMILIES),
        "built-in id": frozenset(f.builtin for f in FAMILIES),
    }


FORBIDDEN = _forbidden()
#: Names no identifier or string may carry.
IDENTIFIERS = FORBIDDEN["family class"] | FORBIDDEN["pipeline class"] | FORBIDDEN["component"] \
    | FORBIDDEN["family-only attribute"] | FORBIDDEN["explicit"]
STRINGS = IDENTIFIERS | FORBIDDEN["family id"] | FORBIDDEN["embedding key"]
#: Names code may not decide by (plain values allowed).
DECISIONS = FORBIDDEN["objective"] | FORBIDDEN["built-in id"]
#: Modules that define a family class (base.py's interface and tiny.py's helpers are shared, not a family).
FAMILY_MODULES = frozenset(c.__module__ for c in _family_classes())
BUILTIN_RE = re.compile("|".join(re.escape(b) for b in sorted(FORBIDDEN["built-in id"], key=len, reverse=True)))


def _distinctive(name: str) -> bool:
    """A name that cannot be an English word in a message: it has a digit, an underscore or a capital."""
    return bool(re.search(r"[0-9_A-Z]", name))


@dataclass(frozen=True)
class Mention:
    line: int
    name: str
    how: str  # identifier | import | string | word | decision | probe | value

    @property
    def violation(self) -> bool:
        return self.how != "value"


def _docstrings(tree: ast.AST) -> set[int]:
    nodes = (n for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                                         ast.AsyncFunctionDef)))
    return {id(n.body[0].value) for n in nodes
            if n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}


def _decision_constants(tree: ast.AST) -> set[int]:
    """Constants code branches or looks up by: compared (alone or in a literal tuple/list/set), dict keys,
    match cases, startswith/endswith arguments."""
    found: list[ast.AST] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for operand in (node.left, *node.comparators):
                found += operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
        elif isinstance(node, ast.Dict):
            found += [k for k in node.keys if k is not None]
        elif isinstance(node, ast.MatchValue):
            found.append(node.value)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in ("startswith", "endswith"):
            for arg in node.args:
                found += arg.elts if isinstance(arg, ast.Tuple) else [arg]
    return {id(n) for n in found if isinstance(n, ast.Constant)}


def _names_of(node: ast.AST) -> list[str]:
    """The identifiers a node introduces or uses."""
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    if isinstance(node, (ast.keyword, ast.arg)):
        return [node.arg] if node.arg else []
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.alias):
        return [n for n in (node.name.rsplit(".", 1)[-1], node.asname) if n]
    return []


def _mentions_family(node: ast.AST) -> bool:
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return "famil" in name.lower()


def mentions(source: str) -> list[Mention]:
    """Every mention of a family-specific name in `source`, violations and plain values alike."""
    tree = ast.parse(source)
    docs, decisions = _docstrings(tree), _decision_constants(tree)
    out: list[Mention] = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        out += [Mention(line, n, "identifier") for n in _names_of(node) if n in IDENTIFIERS]
        if isinstance(node, ast.ImportFrom) and node.module in FAMILY_MODULES:
            out.append(Mention(line, node.module, "import"))
        if isinstance(node, ast.Import):
            out += [Mention(line, a.name, "import") for a in node.names if a.name in FAMILY_MODULES]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") \
                and node.args and _mentions_family(node.args[0]):
            out.append(Mention(line, ast.unparse(node), "probe"))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            out += _string_mentions(node.value, line, id(node) in decisions)
    return out


def _string_mentions(text: str, line: int, decides: bool) -> list[Mention]:
    if text in STRINGS:
        return [Mention(line, text, "string")]
    if text in DECISIONS:
        return [Mention(line, text, "decision" if decides else "value")]
    found = [Mention(line, b, "decision" if decides else "value") for b in BUILTIN_RE.findall(text)]
    words = set(re.findall(r"\w+", BUILTIN_RE.sub(" ", text)))
    return found + [Mention(line, w, "word") for w in sorted(words & STRINGS) if _distinctive(w)]


def _modules(*tops: str) -> list[Path]:
    return sorted(p for top in tops for p in (ROOT / top).rglob("*.py"))


def test_no_module_outside_the_families_names_a_family() -> None:
    problems, allowed_seen = [], set()
    for path in _modules(*SCANNED):
        if FAMILIES_DIR in path.parents:
            continue
        rel = path.relative_to(ROOT).as_posix()
        for m in mentions(path.read_text()):
            if not m.violation:
                continue
            if (rel, m.name) in ALLOWED:
                allowed_seen.add((rel, m.name))
                continue
            problems.append(f"{rel}:{m.line}: {m.name!r} ({m.how})")
    assert not problems, ("family-specific names outside tasks/common/families/ (ask the family instead):\n"
                          + "\n".join(problems))
    assert allowed_seen == set(ALLOWED), f"stale ALLOWED entries: {set(ALLOWED) - allowed_seen}"


def test_the_rule_finds_every_name_inside_the_families() -> None:
    """Not vacuous: the same reader, run over the families package, finds every name it forbids elsewhere."""
    seen = {m.name for path in _modules("tasks/common/families") for m in mentions(path.read_text())}
    for kind, names in FORBIDDEN.items():
        assert names, kind
        assert names <= seen, f"{kind}: {sorted(names - seen)} never found in tasks/common/families/"
    assert {"text_encoder_2", "text_encoder_3", "tokenizer_2", "transformer", "unet"} <= FORBIDDEN["component"]
    assert {"sd", "sdxl", "sd3", "flux", "flux2"} <= FORBIDDEN["family id"]
    assert {"StableDiffusionXLPipeline", "FluxPipeline", "OVFluxPipeline"} <= FORBIDDEN["pipeline class"]
    assert {"temporal_compression", "t5_tokenizer", "chat"} <= FORBIDDEN["family-only attribute"]
    assert "flow_matching" in FORBIDDEN["objective"] and "builtin:tiny-sdxl" in FORBIDDEN["built-in id"]
    assert set(FORBIDDEN["built-in id"]) == set(families.BUILTINS)


def test_the_rule_reports_each_kind_of_naming_with_its_line() -> None:
    source = '''"""Docstrings may say sdxl, text_encoder_2, FluxPipeline and flow_matching."""
from tasks.common.families.sdxl import add_time_ids
from diffusers import StableDiffusionXLPipeline
if family.denoiser.objective == "flow_matching":
    scheme = getattr(family, "temporal_compression", None)
encoder = pipe.text_encoder_2
if model in ("builtin:tiny-sd", "builtin:tiny-sdxl"):
    pass
kind = {"sdxl": 1}
raise ValueError(f"no {name}/openvino_model.xml in transformer/")
part = getattr(pipe, "unet")
message = "keys clip_l/clip_g of text_encoder_2 (SDXL: 2 transformer blocks)"
fine = ("ddpm", "builtin:tiny-flux2 | a hub id", "SDXL and FLUX.1 are prose", family.denoiser.name)
'''
    got = {(m.line, m.name, m.how) for m in mentions(source) if m.violation}
    assert got == {
        (2, "tasks.common.families.sdxl", "import"),
        (3, "StableDiffusionXLPipeline", "identifier"),
        (4, "flow_matching", "decision"),
        (5, "temporal_compression", "string"),
        (5, "getattr(family, 'temporal_compression', None)", "probe"),
        (6, "text_encoder_2", "identifier"),
        (7, "builtin:tiny-sd", "decision"),
        (7, "builtin:tiny-sdxl", "decision"),
        (9, "sdxl", "string"),
        (11, "unet", "string"),
        (12, "clip_l", "word"),
        (12, "clip_g", "word"),
        (12, "text_encoder_2", "word"),
    }
    values = {(m.line, m.name) for m in mentions(source) if not m.violation}
    assert values == {(13, "ddpm"), (13, "builtin:tiny-flux2")}


#: Names a pipeline object goes by in tasks/ and flows/.
PIPELINE_NAMES = {"pipe", "pt_pipe", "ov_pipe", "pipeline", "runner"}
#: Where a pipeline is called directly: the one call (pipeline_call.py), GenAI's own API behind the
#: stand-ins that ModelFamily.generate calls (genai.py; genai_serving.py is the served model's code).
PIPELINE_CALLERS = {"finetune_runtime/pipeline_call.py", "tasks/common/genai.py", "finetune_runtime/genai_serving.py"}


def pipeline_calls(source: str) -> list[int]:
    """Lines that call a pipeline object directly: `pipe(...)`, `self.pipe(...)`, `pipe.generate(...)`."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr == "generate":
            func = func.value  # GenAI's Text2ImagePipeline.generate
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        if name in PIPELINE_NAMES:
            lines.append(node.lineno)
    return lines


def test_every_pipeline_call_goes_through_the_family() -> None:
    problems = [f"{path.relative_to(ROOT).as_posix()}:{line}" for path in _modules(*SCANNED)
                if FAMILIES_DIR not in path.parents and path.relative_to(ROOT).as_posix() not in PIPELINE_CALLERS
                for line in pipeline_calls(path.read_text())]
    assert not problems, "pipelines called directly (call family.generate instead):\n" + "\n".join(problems)
    assert pipeline_calls("pipe(prompt='x')\nself.pipe(**k)\nself.pipe.generate('x')\nfamily.generate(pipe)\n") \
        == [1, 2, 3]
