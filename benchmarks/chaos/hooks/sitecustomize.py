"""The chaos run's window opener, loaded by every Python process of the worker it starts (this
folder is first on the worker's PYTHONPATH, `CHAOS_WINDOW_DIR` set; nothing happens without it).

The registration's writes after `create_model_version` take milliseconds, too short for a kill at
a random moment to land between them. When `tasks.register.core` is imported, each point of
`POINTS` is wrapped: after the named step returns, if `<CHAOS_WINDOW_DIR>/armed` names that
point, the process writes `<dir>/hit` and waits there, so the harness kills the worker exactly at
that moment (benchmarks/chaos/kills.py, target `registration`). The project's code is unchanged."""
from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
import time
from pathlib import Path

#: point -> (module, function): the kill lands right after the function returns
POINTS = {
    "model_logged": ("tasks.register.core", "_log"),  # files stored, no version yet
    "version_created": ("tasks.register.core", "create_version"),  # lineage names no version
    "lineage_named": ("tasks.register.core", "name_the_version"),  # no alias moved
    "aliases_moved": ("tasks.register.core", "move_aliases"),  # lineage digest not recorded
}


def _pause_after(name: str, fn):
    folder = Path(os.environ["CHAOS_WINDOW_DIR"])

    def wrapped(*args, **kwargs):
        result = fn(*args, **kwargs)
        armed = folder / "armed"
        if armed.is_file() and armed.read_text().strip() == name:
            (folder / "hit").write_text(f"{name} {os.getpid()}\n")
            time.sleep(600)  # killed here
        return result

    return wrapped


class _Opener(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != "tasks.register.core":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            for point, (_, function) in POINTS.items():
                setattr(module, function, _pause_after(point, getattr(module, function)))

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("CHAOS_WINDOW_DIR"):
    sys.meta_path.insert(0, _Opener())
