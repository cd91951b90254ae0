"""Where and how it runs (tasks/common/launch.py; README "Launchers"): the launcher and its
topology, the CPU back end, torch.compile, PyTorch/XLA's options."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from tasks.common.config import StageConfig
from tasks.common.launch import LAUNCHERS, LaunchConfig, launch_problem
from tasks.train.config_sections import XlaConfig


class LaunchSection(StageConfig):
    launcher: Literal[LAUNCHERS] = Field(  # type: ignore[valid-type]
        "local", description="local | accelerate | mpirun | xla: python -m tasks.train re-executes itself under it"
    )
    launch: LaunchConfig = Field(default_factory=LaunchConfig, description="topology and environment of a launch")
    # back ends (tasks/train/README.md, "CPU and TPU back ends")
    cpu_backend: Literal["auto", "ipex", "native"] = Field(
        "auto", description="CPU runs: ipex (Intel Extension for PyTorch's ipex.optimize) | native (torch autocast) "
                            "| auto (ipex when it imports and matches torch, else native)"
    )
    torch_compile: bool = Field(False, description="torch.compile the UNet (CPU and GPU runs)")
    xla: XlaConfig = Field(default_factory=XlaConfig, description="PyTorch/XLA options (used when torch_xla runs)")

    def _launch_problem(self) -> str | None:
        return launch_problem(self.launcher, self.launch)
