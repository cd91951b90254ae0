"""The model's libraries kept quiet while it loads and predicts, in the Python that loads it.

A registered version runs in its user's own Python (`mlflow.pyfunc.load_model(...)`, then
`predict`) and in the worker of `mlflow models serve`. There the libraries it imports (torch,
torchao, diffusers, transformers, optimum-intel, bitsandbytes, ...) print deprecations, fallbacks,
the safety-checker paragraph and progress bars that say nothing about the user's request.
`libraries_quiet()` is the scope the model loads and predicts in: inside it those libraries'
loggers are at ERROR, Python warnings are ignored (one filter, first in the list), and diffusers',
transformers' and huggingface_hub's progress bars are off. On leaving it (the last thread to leave,
where requests overlap) each is as it was: our filter goes, the filters libraries add as they are
imported stay, and a library first imported inside is left at its own default level.
The process's own logging (its root logger, handlers, and every other logger) is never touched,
and errors still show.

`LOG_LEVEL=DEBUG` in the environment (the stages' switch) leaves everything as the libraries set
it. MLflow's "Downloading artifacts" bars come before any of the model's code runs: the
environment's `MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR=false` turns them off (the project's `models:/`
resolver turns them off for its own downloads unless that variable is set).
"""
from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys
import threading
import warnings
from collections.abc import Callable, Iterator

#: the libraries whose loggers are at ERROR inside the scope
LIBRARIES = ("torch", "torchao", "diffusers", "transformers", "optimum", "nncf", "openvino", "bitsandbytes",
             "huggingface_hub", "accelerate", "peft")
#: libraries that set their own level as they are first imported, from this variable, and may log
#: while they are imported: imported at the scope's start, their import-time lines at ERROR
SET_ON_IMPORT = {"transformers": "TRANSFORMERS_VERBOSITY", "diffusers": "DIFFUSERS_VERBOSITY"}
#: the modules that switch a library's progress bars
BAR_SWITCHES = ("transformers.utils.logging", "diffusers.utils.logging")
VERBOSE_ENV = "LOG_LEVEL"
#: the filter `warnings.simplefilter("ignore")` adds
IGNORE_ALL = ("ignore", None, Warning, None, 0)

_lock = threading.Lock()
_depth = 0
_undo: list[Callable[[], None]] = []


def verbose() -> bool:
    """Whether the libraries speak as they would (`LOG_LEVEL=DEBUG`)."""
    return os.environ.get(VERBOSE_ENV, "").strip().upper() == "DEBUG"


@contextlib.contextmanager
def libraries_quiet(import_first: bool = True) -> Iterator[None]:
    """The scope the model loads and predicts in (see the module's docstring); nests, and overlaps
    across threads: the first to enter quiets, the last to leave restores. `import_first`: import
    torch, transformers and diffusers quietly first (the load; a request, which runs after it, finds
    them imported and must not spend its time budget importing them)."""
    global _depth
    if verbose():
        yield
        return
    with _lock:
        _depth += 1
        if _depth == 1:
            _undo[:] = _quiet(import_first)
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                for undo in reversed(_undo):
                    undo()
                _undo.clear()


def _quiet(import_first: bool) -> list[Callable[[], None]]:
    """Warnings ignored, library loggers at ERROR, bars off; the undo of each, in order."""
    undo: list[Callable[[], None]] = []
    if IGNORE_ALL not in warnings.filters:  # (the same filter of the user's would move, then go)
        warnings.simplefilter("ignore")
        undo.append(_filter_remover(warnings.filters[0]))
    if import_first:
        _import_quietly()
    for name in LIBRARIES:
        logger = logging.getLogger(name)
        if logger.level < logging.ERROR:
            undo.append(_level_restorer(logger, logger.level))
            logger.setLevel(logging.ERROR)
    return undo + _bars_off()


def _filter_remover(ours: tuple) -> Callable[[], None]:
    """Removes our filter alone: those the libraries add meanwhile, as they are imported, stay."""
    def remove() -> None:
        for i, entry in enumerate(warnings.filters):
            if entry is ours:
                del warnings.filters[i]
                getattr(warnings, "_filters_mutated", lambda: None)()
                return
    return remove


def _level_restorer(logger: logging.Logger, level: int) -> Callable[[], None]:
    def restore() -> None:
        if logger.level == logging.ERROR:  # a library that set its own level meanwhile keeps it
            logger.setLevel(level)
    return restore


def _import_quietly() -> None:
    """torch resets its loggers as it is imported; transformers and diffusers set their level from
    their variable and diffusers logs as it is imported ("Multiple distributions found ..."). Imported
    here with that variable at `error`, then left at the level their own import would have set."""
    with contextlib.suppress(ImportError):
        import torch  # noqa: F401  (prints nothing itself)
    for name, variable in SET_ON_IMPORT.items():
        if f"{name}.utils.logging" in sys.modules:
            continue
        users = os.environ.get(variable)
        os.environ[variable] = "error"
        try:
            module = importlib.import_module(f"{name}.utils.logging")
            module.get_verbosity()  # configures the library's logger, at the variable's level
        except ImportError:
            continue
        finally:
            if users is None:
                os.environ.pop(variable, None)
            else:
                os.environ[variable] = users
        default = getattr(module, "_get_default_logging_level", lambda: logging.WARNING)
        logging.getLogger(name).setLevel(default())


def _bars_off() -> list[Callable[[], None]]:
    """diffusers', transformers' and huggingface_hub's bars off; the undo of each (the hub's, its
    switches by group, last: transformers' switch turns the hub's bars on and off with its own)."""
    undo: list[Callable[[], None]] = []
    hub = sys.modules.get("huggingface_hub.utils.tqdm")
    states = getattr(hub, "progress_bar_states", None)
    if isinstance(states, dict):
        before = dict(states)
        undo.append(lambda: (states.clear(), states.update(before)))
    for name in BAR_SWITCHES:
        module = sys.modules.get(name)
        if module is not None and module.is_progress_bar_enabled():
            module.disable_progress_bar()
            undo.append(module.enable_progress_bar)
    if hub is not None:
        hub.disable_progress_bars()
    return undo
