"""The import graph of tasks/ and flows/, read from the source with `ast`: no import cycles (imports
inside functions count), no stage importing another stage's code, and dvc.yaml's code deps as the
graph says (tasks/common/stage_deps.py). Fast: nothing here imports the modules it reads."""
from __future__ import annotations

from pathlib import Path

import pytest

from tasks.common.stage_deps import (
    closure,
    cycles,
    differences,
    find_cycle,
    generated_deps,
    import_graph,
    listed_deps,
    rewrite,
)
from tests.conftest import REPO

pytestmark = pytest.mark.quick  # make test-fast

GRAPH = import_graph(REPO)
#: tasks/<package>: a stage's code (tasks.common is shared; tasks.register is the flow's last step)
STAGE_PACKAGES = sorted({name.split(".")[1] for name in GRAPH if name.startswith("tasks.")} - {"common"})


def show(cycle: list[str]) -> str:
    return " -> ".join(cycle)


def test_no_import_cycles() -> None:
    found = cycles(GRAPH)
    assert not found, "import cycles (move the piece both sides need where it belongs, e.g. a module " \
                      "of its own):\n" + "\n".join(show(c) for c in found)


def test_the_graph_covers_tasks_and_flows_with_lazy_and_relative_imports() -> None:
    assert {"tasks.train.__main__", "tasks.common.launch", "flows.finetune"} <= set(GRAPH)
    assert "tasks.common.launch" in GRAPH["tasks.train.__main__"]
    assert "tasks.train.stage" in GRAPH["tasks.train.__main__"], "imported inside main()"
    assert "tasks.train.xla" in GRAPH["tasks.train.backend"], "imported inside choose_backend()"


def test_the_cycle_finder_finds_cycles_in_a_small_graph() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}, "f": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert cycles(graph) == [["a", "b", "c", "a"], ["e", "e"]]
    graph["c"] = {"d"}
    graph["e"] = set()
    assert find_cycle(graph) is None and cycles(graph) == []


def write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_the_graph_builder_resolves_imports_and_catches_a_cycle_through_a_lazy_import(tmp_path) -> None:
    write(tmp_path, {
        "tasks/__init__.py": "",
        "tasks/common/__init__.py": "",
        "tasks/common/a.py": "from tasks.common import b\nimport json\n",
        "tasks/common/b.py": "def f():\n    from .c import g\n    return g\n",
        "tasks/common/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import tasks.common.a\n",
        "tasks/common/d.py": "from ..common import e as _\nfrom . import b\n",
        "tasks/common/e.py": "import tasks.common.b as bee\n",
        "tasks/st/__init__.py": "",
        "tasks/st/__main__.py": "from tasks.common.d import x\n",
    })
    graph = import_graph(tmp_path, ["tasks"])
    assert graph["tasks.common.a"] == {"tasks.common.b"}
    assert graph["tasks.common.b"] == {"tasks.common.c"}
    assert graph["tasks.common.c"] == {"tasks.common.a"}
    assert graph["tasks.common.d"] == {"tasks.common.e", "tasks.common.b"}
    assert graph["tasks.common.e"] == {"tasks.common.b"}
    assert graph["tasks.st.__main__"] == {"tasks.common.d"}
    assert cycles(graph) == [["tasks.common.a", "tasks.common.b", "tasks.common.c", "tasks.common.a"]]
    assert closure(graph, "tasks.st.__main__") == {
        "tasks", "tasks.common", "tasks.st", "tasks.st.__main__", "tasks.common.a", "tasks.common.b",
        "tasks.common.c", "tasks.common.d", "tasks.common.e"}


def test_no_stage_imports_another_stage() -> None:
    crossings = []
    for name, targets in GRAPH.items():
        parts = name.split(".")
        if parts[0] != "tasks" or len(parts) < 2:
            continue
        for target in targets:
            other = target.split(".")
            if len(other) > 1 and other[0] == "tasks" and other[1] != parts[1] and other[1] in STAGE_PACKAGES:
                crossings.append(f"{name} imports {target}")
    assert not crossings, "a stage never imports another stage (shared code goes to tasks/common):\n" + \
        "\n".join(sorted(crossings))


def test_dvc_yaml_lists_each_stage_s_imported_code() -> None:
    problems = differences(REPO)
    assert not problems, "dvc.yaml's code deps differ from what the stages import; run " \
                         "`python -m tasks.common.stage_deps --write`:\n" + "\n".join(problems)
    text = (REPO / "dvc.yaml").read_text()
    assert rewrite(text, generated_deps(REPO)) == text, "in step, but not as --write writes them (order)"
    deps = listed_deps(REPO / "dvc.yaml")
    assert [s for s, paths in deps.items() if "tasks/common/launch.py" in paths] == ["class_images", "train"]
    assert all("tasks/common" not in paths for paths in deps.values()), "no stage runs all of tasks/common"


DVC_YAML = """\
stages:
  one:
    cmd: python -m tasks.st --out x
    deps:
      - tasks/st
      - tasks/common/b.py   # stale
      - data/in             # a data dep stays
    outs:
      - x
  two:
    cmd: python -m tasks.other
    deps:
      - data/in
"""


@pytest.fixture
def toy_repo(tmp_path) -> Path:
    write(tmp_path, {
        "tasks/__init__.py": "",
        "tasks/common/__init__.py": "",
        "tasks/common/a.py": "",
        "tasks/common/b.py": "",
        "tasks/st/__init__.py": "",
        "tasks/st/__main__.py": "def main():\n    from tasks.common.a import f\n",
        "tasks/other/__init__.py": "",
        "tasks/other/__main__.py": "from tasks.common import a, b\n",
        "dvc.yaml": DVC_YAML,
    })
    return tmp_path


def test_the_check_names_the_stage_and_the_missing_and_extra_paths_and_write_fixes_them(toy_repo) -> None:
    assert differences(toy_repo) == [
        "stage one: missing tasks/__init__.py, tasks/common/__init__.py, tasks/common/a.py; extra tasks/common/b.py",
        "stage two: missing tasks/__init__.py, tasks/common, tasks/other"]
    dvc_yaml = toy_repo / "dvc.yaml"
    dvc_yaml.write_text(rewrite(dvc_yaml.read_text(), generated_deps(toy_repo)))
    assert differences(toy_repo) == []
    assert dvc_yaml.read_text() == DVC_YAML.replace(
        "      - tasks/common/b.py   # stale\n",
        "      - tasks/__init__.py\n      - tasks/common/__init__.py\n      - tasks/common/a.py\n",
    ).replace(
        "tasks.other\n    deps:\n",
        "tasks.other\n    deps:\n      - tasks/other\n      - tasks/__init__.py\n      - tasks/common\n",
    ), "code deps replaced in place, the data dep and its comment kept"


def test_the_runtime_package_imports_nothing_of_the_project() -> None:
    """finetune_runtime/ is the registered model's whole code: it loads where tasks/ and flows/ cannot
    be imported (tests/register/test_register.py loads a version so), so it imports neither."""
    runtime = import_graph(REPO, ("finetune_runtime", "tasks", "flows"))
    own = "finetune_runtime"
    problems = sorted(f"{name} imports {other}" for name, others in runtime.items()
                      if name.startswith(own) for other in others if not other.startswith(own))
    assert {"finetune_runtime.model", "finetune_runtime.size"} <= set(runtime)
    assert not problems, "the served model's code must stand alone:\n" + "\n".join(problems)


def test_every_param_dvc_yaml_names_is_in_params_yaml() -> None:
    """DVC refuses to run a stage whose `params:` names a key params.yaml lacks ("Parameters '...' are
    missing from 'params.yaml'"), even where the stage's config has a default for it: each named key,
    a section or a dotted key, must be in the file."""
    import yaml

    params = yaml.safe_load((REPO / "params.yaml").read_text())
    missing = []
    for name, stage in yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"].items():
        for entry in stage.get("params", []):
            for key in entry if isinstance(entry, dict) else [entry]:
                node: object = params
                for part in str(key).split("."):
                    node = node.get(part, KeyError) if isinstance(node, dict) else KeyError
                if node is KeyError:
                    missing.append(f"{name}: {key}")
    assert not missing, f"dvc.yaml names params that params.yaml lacks: {missing}"
