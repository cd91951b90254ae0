"""A stage's terminal shows the project's own log lines; every other library's go to its log file.

`quiet(stage)` runs in `main_guard` right after logging is configured. Records of the project's
loggers (`tasks.*`, `flows.*`, `__main__`, and the flow's Prefect run loggers) and records at ERROR
or above from anyone reach the terminal as before; the rest (MLflow, transformers, diffusers, torch,
bitsandbytes, Python warnings through `py.warnings`, ...) are appended to `.cache/logs/<stage>.log`
under the working directory. `LOG_LEVEL=DEBUG` turns the routing off: everything shows on the
terminal, as it was before.

Several libraries write to the terminal through stream handlers of their own, installed when they
are imported, often after the stage started (transformers, diffusers, torch, MLflow, nncf). The
gate is therefore one wrapper around `logging.Handler.handle`: any handler that writes to the
terminal (a stream handler other than a file's, or torch's `_StderrHandler`), whoever installed it
and whenever, passes the project's records and errors, and sends the rest to the log file (each
record once). Other handlers (files, Prefect's API handler, pytest's capture) are left alone.
"""
from __future__ import annotations

import datetime
import importlib.abc
import logging
import os
import sys
from pathlib import Path

#: logger names whose records are the project's own lines
PROJECT = ("tasks", "flows", "__main__", "prefect.flow_runs", "prefect.task_runs")
#: set in the environment once the log file was announced (a re-executed stage, its ranks)
ANNOUNCED = "SD_PIPELINE_LOG_FILE"
LOG_DIR = Path(".cache/logs")

_file: logging.Handler | None = None
_original_handle = logging.Handler.handle


def is_project(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in PROJECT)


def is_terminal(handler: logging.Handler) -> bool:
    """A handler writing to stderr/stdout: stream handlers but a file's, torch's `_StderrHandler`."""
    if isinstance(handler, logging.StreamHandler):
        return not isinstance(handler, logging.FileHandler)
    return type(handler).__name__.endswith("StderrHandler")


def _gated_handle(self: logging.Handler, record: logging.LogRecord):
    if (_file is None or record.levelno >= logging.ERROR or is_project(record.name)
            or not is_terminal(self)):
        return _original_handle(self, record)
    if not getattr(record, "_sd_filed", False):
        record._sd_filed = True
        _file.handle(record)
    return False


class _RunLog(logging.FileHandler):
    """The stage's log file, created (folder, header line) at its first record: a stage that
    stops before any other library speaks leaves no file."""

    def _open(self):
        Path(self.baseFilename).parent.mkdir(parents=True, exist_ok=True)
        stream = super()._open()
        stamp = datetime.datetime.now().isoformat(timespec="seconds")
        stream.write(f"==== {stamp} pid {os.getpid()}: {' '.join(sys.argv)}\n")
        return stream


def quiet(stage: str, verbose: bool) -> Path | None:
    """Route third-party log records of this process to `.cache/logs/<stage>.log` (None: verbose)."""
    global _file
    logging.captureWarnings(True)
    if verbose:
        return None
    path = LOG_DIR / f"{stage}.log"
    handler = _RunLog(path, mode="a", encoding="utf-8", delay=True)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    _file = handler
    logging.Handler.handle = _gated_handle
    _progress_bars_off()
    if os.environ.get(ANNOUNCED) != str(path.resolve()):
        os.environ[ANNOUNCED] = str(path.resolve())
        logging.getLogger("tasks.common.quiet").info(
            "other libraries' log lines and warnings go to %s (LOG_LEVEL=DEBUG shows them here)", path)
    return path


def _progress_bars_off() -> None:
    """Libraries' progress bars (Hugging Face downloads, shard writing, diffusers' component
    loading, MLflow's artifact downloads) off; the project's own bars (plain tqdm) stay."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # read by huggingface_hub at import
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # read at each download
    if "huggingface_hub" in sys.modules:
        sys.modules["huggingface_hub"].utils.disable_progress_bars()
    for lib in BAR_SWITCHES:
        if lib in sys.modules:
            sys.modules[lib].disable_progress_bar()
    if not any(isinstance(f, _BarsOffOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _BarsOffOnImport())


#: the modules whose `disable_progress_bar()` turns a library's bars off (diffusers' start on)
BAR_SWITCHES = ("transformers.utils.logging", "diffusers.utils.logging")


class _BarsOffOnImport(importlib.abc.MetaPathFinder):
    """Turns a library's bars off as its logging module is imported: diffusers and transformers
    are mostly imported after the stage started, and diffusers ignores the environment."""

    def find_spec(self, name, path, target=None):
        if name not in BAR_SWITCHES:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = finder.find_spec(name, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None and spec.loader is not None:
                spec.loader = _BarsOffLoader(spec.loader)
                return spec
        return None


class _BarsOffLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        module.disable_progress_bar()


def stage_name() -> str:
    """`base` for `python -m tasks.base`, `finetune` for `python -m flows.finetune` or a script's stem."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:
        parts = [p for p in spec.name.split(".") if p != "__main__"]
        return parts[-1]
    return Path(sys.argv[0]).stem or "python"
