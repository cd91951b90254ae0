"""finetune_runtime/quiet.py: the scope the served model loads and predicts in quiets the libraries and
leaves the process's logging, warning filters and progress bars as it found them. (A fresh Python that
loads a registered version and prints nothing: tests/register/test_register.py.)"""
from __future__ import annotations

import logging
import threading
import warnings

import pytest

from finetune_runtime import quiet
from finetune_runtime.quiet import LIBRARIES, libraries_quiet

pytestmark = pytest.mark.quick  # make test-fast


def _state() -> tuple:
    from diffusers.utils import logging as diffusers_logging
    from huggingface_hub.utils import are_progress_bars_disabled
    from transformers.utils import logging as transformers_logging

    return ({name: logging.getLogger(name).level for name in (*LIBRARIES, "", "mlflow")}, list(warnings.filters),
            diffusers_logging.is_progress_bar_enabled(), transformers_logging.is_progress_bar_enabled(),
            are_progress_bars_disabled())


@pytest.fixture
def loud(monkeypatch: pytest.MonkeyPatch):
    """Libraries as a user's Python leaves them (the user's transformers at INFO), LOG_LEVEL unset."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    monkeypatch.delenv("LOG_LEVEL", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("default")
        before = [logging.getLogger(n).level for n in ("transformers", "diffusers")]
        bars = diffusers_logging.is_progress_bar_enabled(), transformers_logging.is_progress_bar_enabled()
        logging.getLogger("transformers").setLevel(logging.INFO)
        logging.getLogger("diffusers").setLevel(logging.WARNING)
        diffusers_logging.enable_progress_bar()
        transformers_logging.enable_progress_bar()
        yield
        for name, level in zip(("transformers", "diffusers"), before):
            logging.getLogger(name).setLevel(level)
        for module, on in zip((diffusers_logging, transformers_logging), bars):
            (module.enable_progress_bar if on else module.disable_progress_bar)()


def test_inside_the_libraries_are_quiet_and_after_as_they_were(loud, caplog: pytest.LogCaptureFixture) -> None:
    from diffusers.utils import logging as diffusers_logging

    before = _state()
    with libraries_quiet(), warnings.catch_warnings(record=True) as shown:
        for name in ("diffusers.pipelines", "torch.utils._pytree", "bitsandbytes.backends", "transformers"):
            assert not logging.getLogger(name).isEnabledFor(logging.WARNING), name
            assert logging.getLogger(name).isEnabledFor(logging.ERROR), name
        logging.getLogger("bitsandbytes.backends.cpu.ops").warning("a fallback")
        logging.getLogger("tests.register").warning("the user's own line")
        warnings.warn("a library's FutureWarning", FutureWarning, stacklevel=1)
        assert not diffusers_logging.is_progress_bar_enabled()
        assert logging.getLogger().level == before[0][""]  # the root, and the user's loggers: untouched
    assert shown == []
    assert [r.getMessage() for r in caplog.records] == ["the user's own line"]
    assert _state() == before


def test_the_last_to_leave_restores(loud) -> None:
    before = _state()
    inside, leave = threading.Event(), threading.Event()

    def request() -> None:
        with libraries_quiet():
            inside.set()
            leave.wait(10)

    other = threading.Thread(target=request)
    with libraries_quiet():
        other.start()
        inside.wait(10)
    assert logging.getLogger("transformers").level == logging.ERROR  # the other request is still in
    leave.set()
    other.join(10)
    with libraries_quiet(), libraries_quiet():  # nested
        pass
    assert _state() == before and quiet._depth == 0


def test_a_filter_a_library_adds_inside_stays(loud) -> None:
    with libraries_quiet():
        warnings.filterwarnings("ignore", message="a library's own filter")
    assert warnings.filters[0][1].pattern == "a library's own filter"
    assert quiet.IGNORE_ALL not in warnings.filters


def test_log_level_debug_leaves_the_libraries_speaking(loud, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOG_LEVEL", "debug")
    before = _state()
    with libraries_quiet():
        assert _state() == before
