"""Where and how it runs (tasks/common/launch.py; tasks/train/README.md, "Launchers"): the launcher and its
topology, the CPU back end, torch.compile, PyTorch/XLA's options (`train.xla`)."""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from tasks.common.config import StageConfig
from tasks.common.launch import LAUNCHERS, LaunchConfig, launch_problem


class XlaConfig(StageConfig):
    """`train.xla`: PyTorch/XLA (TPU, or CPU with PJRT_DEVICE=CPU) options, after diffusers' SDXL-on-TPU script."""

    mesh_shape: list[int] | None = Field(
        None, min_length=1, max_length=2,
        description="SPMD device mesh (data[, model]); the batch is sharded over its first axis. "
                    "null: every device on one data axis (data parallel)",
    )
    compile_cache_dir: Path | None = Field(
        Path(".cache/xla"), description="persistent XLA compile cache (its CACHE_DIR); null: none"
    )
    profile_dir: Path | None = Field(None, description="write an XLA profile trace here (its PROFILE_DIR); null: off")
    profile_start_step: int = Field(10, ge=1, description="first optimizer step inside the profile window")
    profile_steps: int = Field(5, ge=1, description="optimizer steps the profile window covers")
    loader_prefetch_size: int = Field(1, ge=1, description="batches the host loader keeps ready")
    device_prefetch_size: int = Field(1, ge=1, description="batches already sent to the devices")


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
