"""Each stage's code in dvc.yaml, from the import graph: `python -m tasks.common.stage_deps --check | --write`.

A stage (`python -m tasks.<stage>`) depends on the modules of tasks/ and finetune_runtime/ that its
command imports, directly or through other modules, at the top of a module or inside a function (`import` and
`from ... import`, relative imports resolved), and on the `__init__.py` of every package on the
way (Python runs them first). A package whose every module the stage imports is listed as its
folder, any other module by its file. So a change to a module reruns the stages that run it and
no other (tasks/common/launch.py: class_images and train).

- `--check` (the default): exit 1 naming each stage whose code deps in dvc.yaml are missing a
  module it imports or list one it does not (tests/test_imports.py runs the same comparison);
- `--write`: rewrite the `- tasks/...` and `- finetune_runtime/...` lines of each stage's deps; every other line
  (data deps, comments) stays as it is.

The graph is read from the source with `ast`, never by importing it; tests/test_imports.py also
holds it free of import cycles and stages free of each other's code.
"""
from __future__ import annotations

import argparse
import ast
import re
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("tasks", "flows")
#: the code a stage's command can import: the stages' packages and the runtime package they share
#: with the served model (finetune_runtime/)
STAGE_CODE = ("tasks", "finetune_runtime")
STAGE_CMD = re.compile(r"^python -m tasks\.(\w+)(\s|$)")

Graph = dict[str, set[str]]


def module_files(root: Path = ROOT, packages: Iterable[str] = PACKAGES) -> dict[str, Path]:
    """Module name -> its file, for every .py file under the `packages` folders of `root`."""
    modules: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if "__pycache__" in parts:
                continue
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _known(name: str, modules: Mapping[str, Path]) -> str | None:
    """`name` or its longest prefix that is one of `modules` (None: outside them, e.g. torch)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        prefix = ".".join(parts[:end])
        if prefix in modules:
            return prefix
    return None


def imports_of(name: str, path: Path, modules: Mapping[str, Path]) -> set[str]:
    """The modules among `modules` that module `name` (file `path`) imports, anywhere in it."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(filter(None, (_known(alias.name, modules) for alias in node.names)))
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: `.` is this package, each further dot one package up
                base = ".".join([package.rsplit(".", node.level - 1)[0], *([node.module] if node.module else [])])
            else:
                base = node.module or ""
            for alias in node.names:  # `from pkg import mod` imports the module pkg.mod
                target = f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else _known(base, modules)
                if target is not None:
                    found.add(target)
    found.discard(name)
    return found


def import_graph(root: Path = ROOT, packages: Iterable[str] = PACKAGES) -> Graph:
    """Module -> the modules it imports, over the `packages` of `root`."""
    modules = module_files(root, packages)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: Mapping[str, Iterable[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None. Depth-first, in sorted order (a stable answer)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done (no cycle through it)
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)) is not None:
            return cycle
    return None


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """One cycle per group of modules that import each other (strongly connected), as find_cycle gives it."""
    reach = {node: closure(graph, node, packages=False) for node in graph}
    groups = {frozenset(m for m in reach[node] if node in reach.get(m, ())) for node in graph}
    found = []
    for group in sorted(groups, key=sorted):
        cycle = find_cycle({node: set(graph.get(node, ())) & group for node in group})
        if cycle is not None:
            found.append(cycle)
    return found


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:end]) for end in range(1, len(parts))]


def closure(graph: Mapping[str, Iterable[str]], start: str, packages: bool = True) -> set[str]:
    """Every module that runs when `start` runs: what it imports, transitively, and (`packages`)
    the packages (`__init__.py`) of each of them."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo.extend(graph.get(name, ()))
        todo.extend(a for a in _ancestors(name) if packages and a in graph)
    return seen


def as_paths(used: set[str], modules: Mapping[str, Path], root: Path = ROOT) -> list[str]:
    """dvc.yaml deps for the modules `used`: a package's folder when all its modules are used, else files."""
    paths: list[str] = []
    covered: set[str] = set()
    for name in sorted(used, key=lambda n: (n.count("."), n)):  # packages before their modules
        if name in covered:
            continue
        path = modules[name]
        inside = {m for m in modules if m == name or m.startswith(f"{name}.")}
        if path.name == "__init__.py" and len(inside) > 1 and inside <= used:
            paths.append(path.parent.relative_to(root).as_posix())
            covered |= inside
        else:
            paths.append(path.relative_to(root).as_posix())
            covered.add(name)
    return sorted(paths)


def stage_commands(dvc_yaml: Path) -> dict[str, str]:
    """Stage -> the tasks package its command runs (`python -m tasks.<package> ...`)."""
    stages = yaml.safe_load(dvc_yaml.read_text())["stages"]
    found = {name: STAGE_CMD.match(" ".join(str(spec["cmd"]).split())) for name, spec in stages.items()}
    return {name: match.group(1) for name, match in found.items() if match}


def generated_deps(root: Path = ROOT) -> dict[str, list[str]]:
    """Stage -> the code paths its dvc.yaml deps should list: its own package first, then the rest sorted."""
    modules = module_files(root, STAGE_CODE)
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    deps = {}
    for stage, package in stage_commands(root / "dvc.yaml").items():
        paths = as_paths(closure(graph, f"tasks.{package}.__main__"), modules, root)
        own = f"tasks/{package}"
        deps[stage] = sorted(paths, key=lambda p, own=own: (p != own and not p.startswith(f"{own}/"), p))
    return deps


def listed_deps(dvc_yaml: Path) -> dict[str, list[str]]:
    """Stage -> the code paths (`tasks/...`, `finetune_runtime/...`) its deps list in dvc.yaml now."""
    stages = yaml.safe_load(dvc_yaml.read_text())["stages"]
    return {name: [d for d in spec.get("deps", []) if isinstance(d, str) and d.split("/")[0] in STAGE_CODE]
            for name, spec in stages.items()}


def differences(root: Path = ROOT) -> list[str]:
    """One line per stage whose listed code deps differ from the generated ones (empty: in step)."""
    listed = listed_deps(root / "dvc.yaml")
    lines = []
    for stage, want in generated_deps(root).items():
        have = listed.get(stage, [])
        missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
        if missing or extra:
            lines.append(f"stage {stage}: " + "; ".join(
                part for part in (f"missing {', '.join(missing)}" if missing else "",
                                  f"extra {', '.join(extra)}" if extra else "") if part))
    return lines


def rewrite(text: str, deps: Mapping[str, list[str]]) -> str:
    """dvc.yaml's text with each stage's code deps lines (`- tasks/...`, `- finetune_runtime/...`)
    replaced by `deps[stage]`, in
    place of the first of them (or first in the list); all other lines as they were."""
    out: list[str] = []
    stage, in_deps, written = None, False, False
    for line in text.splitlines(keepends=True):
        if m := re.match(r"^  (\w[\w-]*):\s*$", line):
            stage, in_deps = m.group(1), False
        elif re.match(r"^    deps:\s*$", line):
            in_deps, written = True, False
            out.append(line)
            continue
        elif in_deps and not re.match(r"^(      |\s*$)", line):
            in_deps = False
        if in_deps and stage in deps:
            item = re.match(r"^      - ((?:tasks|finetune_runtime)/\S*)", line)
            if item or (not written and re.match(r"^      - ", line)):
                if not written:
                    out.extend(f"      - {path}\n" for path in deps[stage])
                    written = True
                if item:
                    continue
        out.append(line)
    return "".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tasks.common.stage_deps", description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 when dvc.yaml differs (the default)")
    mode.add_argument("--write", action="store_true", help="rewrite the code deps in dvc.yaml")
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository (default: this one)")
    args = parser.parse_args(argv)
    dvc_yaml = args.root / "dvc.yaml"
    if args.write:
        text = dvc_yaml.read_text()
        new = rewrite(text, generated_deps(args.root))
        if new != text:
            dvc_yaml.write_text(new)
        print(f"{dvc_yaml}: code deps {'rewritten' if new != text else 'already in step'}")
    problems = differences(args.root)
    for line in problems:
        print(line, file=sys.stderr)
    if problems:
        print("dvc.yaml's code deps differ from what the stages import: python -m tasks.common.stage_deps --write",
              file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
