"""A tiny SD pipeline built once per session, and its loaded pipeline object."""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_sd(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tasks.common.families import build_tiny_pipeline

    return build_tiny_pipeline("builtin:tiny-sd", 0, tmp_path_factory.mktemp("base") / "tiny-sd")


@pytest.fixture(scope="session")
def tiny_pipe(tiny_sd: Path):
    from tasks.class_images.core import load_pipeline

    return load_pipeline(tiny_sd)
