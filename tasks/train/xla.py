"""PyTorch/XLA: TPUs (or CPUs, with PJRT_DEVICE=CPU), data parallel through SPMD sharding of the batch.

After diffusers' SDXL fine-tuning on TPU v5p with PyTorch/XLA: one process per host runs the
program as if on one large device; the input batch is sharded over the data axis of a device
mesh and the XLA compiler partitions the rest (GSPMD); `train.mixed_precision: bf16` autocasts
to bf16; gradient checkpointing wraps the UNet's transformer blocks with torch_xla's checkpoint
(it keeps XLA from folding the recomputation away); compiled graphs persist in
`train.xla.compile_cache_dir` (the script's CACHE_DIR); `train.xla.profile_dir` (PROFILE_DIR)
traces steps `profile_start_step` .. `profile_start_step + profile_steps - 1`.

accelerate already runs on torch_xla (device, autocast, optimizer and checkpoints); this back end
adds what SPMD needs, through the loop's hooks:
- `start_runtime()` before the Accelerator exists: SPMD mode and the compile cache;
- `prepare()`: XLA gradient checkpointing; the latent and text caches off (each lookup would pull
  tensors back to the host, and cached inputs would reach the UNet unsharded);
- `loader()`: `pl.MpDeviceLoader` sends each batch with the images sharded over the data axis,
  `xs.mark_sharding` shards the other inputs (token ids, sizes) the same way;
- `after_backward()` / `after_step()`: `torch_xla.sync()`, so forward and backward run as one
  graph and the optimizer update as another, before the loop reads the loss and gradient norm.
"""
from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import torch

from tasks.common.errors import UserError
from tasks.common.families import Geometry
from tasks.train.backend_base import Backend
from tasks.train.batch import Batch, ReferenceImages
from tasks.train.config import TrainConfig, XlaConfig

log = logging.getLogger(__name__)

PROFILE_PORT = 9012  # the profiler server's port (the SDXL TPU script's); TensorBoard can capture from it
AXES = ("data", "model")


def start_runtime(cfg: XlaConfig) -> None:
    """SPMD mode and the persistent compile cache; before the first XLA tensor (the Accelerator's device)."""
    import torch_xla
    import torch_xla.runtime as xr

    if cfg.compile_cache_dir is not None and not torch_xla._XLAC._xla_computation_cache_is_initialized():
        path = Path(cfg.compile_cache_dir).resolve()
        path.mkdir(parents=True, exist_ok=True)
        xr.initialize_cache(str(path), readonly=False)
        log.info("XLA compile cache: %s", path)
    xr.use_spmd()


def make_mesh(shape: list[int] | None) -> Any:
    """The device mesh: `shape` (data[, model]) or every device on the data axis."""
    import numpy as np
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    devices = xr.global_runtime_device_count()
    mesh_shape = tuple(shape or (devices,))
    if math.prod(mesh_shape) != devices:
        raise UserError(f"train.xla.mesh_shape {list(mesh_shape)} needs {math.prod(mesh_shape)} devices; this run "
                        f"has {devices} ({os.environ.get('PJRT_DEVICE', 'PJRT_DEVICE unset')}). Set it to null "
                        f"(data parallel over all devices) or to a shape whose product is {devices}")
    return xs.Mesh(np.arange(devices), mesh_shape, AXES[: len(mesh_shape)])


def _batch_spec(t: torch.Tensor) -> tuple[str | None, ...]:
    return ("data",) + (None,) * (t.dim() - 1)


class XlaBackend(Backend):
    """SPMD data parallelism over a device mesh, with sync points at the step boundaries."""

    name = "xla"

    def __init__(self, cfg: TrainConfig, accelerator: Any) -> None:
        import torch_xla.debug.profiler as xp
        import torch_xla.distributed.spmd as xs
        import torch_xla.runtime as xr

        super().__init__(cfg)
        self.device = accelerator.device
        self.mesh = make_mesh(cfg.xla.mesh_shape)
        xs.set_global_mesh(self.mesh)
        self.server = xp.start_server(PROFILE_PORT) if cfg.xla.profile_dir else None
        self.tracing = False
        self.logged_sharding = False
        log.info("back end: xla (PJRT %s, %d devices, SPMD mesh %s over %s; batch sharded over 'data'; "
                 "precision %s)", xr.device_type(), xr.global_runtime_device_count(),
                 dict(self.mesh.shape()), self.device, accelerator.mixed_precision)

    def prepare(self, method: Any, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if method.latent_cache is not None or method.prompt_cache is not None:
            log.info("xla: latent and text caches off (inputs are encoded on the devices, sharded with the batch)")
            method.latent_cache = method.prompt_cache = None
        if self.cfg.gradient_checkpointing:
            self._checkpointing(method.components.denoiser)
        if any(group.get("fused") for group in optimizer.param_groups):
            # torch's fused AdamW kernel exists for CPU/CUDA tensors only; XLA fuses the update itself.
            for group in optimizer.param_groups:
                group["fused"] = False
            optimizer.defaults["fused"] = False
        if self.cfg.torch_compile:
            log.warning("train.torch_compile is ignored under XLA: XLA compiles the whole step itself")
        if self.cfg.xla.profile_dir and self.cfg.xla.profile_start_step == 1:
            self._start_trace()
        return optimizer

    @staticmethod
    def _checkpointing(denoiser: torch.nn.Module) -> None:
        """The TPU script's choice: recompute each BasicTransformerBlock, through torch_xla's checkpoint."""
        from diffusers.models.attention import BasicTransformerBlock
        from torch_xla.distributed.fsdp import checkpoint_module

        denoiser.disable_gradient_checkpointing()  # torch.utils.checkpoint: XLA's CSE would undo it
        blocks = [m for m in denoiser.modules() if isinstance(m, BasicTransformerBlock)]
        for block in blocks:
            checkpoint_module(block)  # patches forward in place: parameters and state_dict keys unchanged
        log.info("xla: gradient checkpointing of %d transformer blocks", len(blocks))

    def loader(self, loader: Iterable[Any]) -> Iterator[Any]:
        import torch_xla.distributed.parallel_loader as pl
        import torch_xla.distributed.spmd as xs

        # accelerate wraps the loader in its own MpDeviceLoader (no sharding): use what it wraps.
        host_loader = getattr(loader, "_loader", loader)
        images = xs.ShardingSpec(self.mesh, ("data", None, None, None))  # applies to the 4-d tensors only
        device_loader = pl.MpDeviceLoader(host_loader, self.device, input_sharding=images,
                                          loader_prefetch_size=self.cfg.xla.loader_prefetch_size,
                                          device_prefetch_size=self.cfg.xla.device_prefetch_size)
        for batch in device_loader:
            batch = self._shard(batch)
            if not self.logged_sharding:
                self._log_sharding(batch)
            yield batch

    def _log_sharding(self, batch: Batch) -> None:
        import torch_xla

        tensors = batch.tensors()
        specs = {k: torch_xla._XLAC._get_xla_sharding_spec(v) for k, v in tensors.items() if v.dim() > 0}
        log.info("xla: batch sharding %s", ", ".join(f"{k} {tuple(tensors[k].shape)} {s or 'replicated'}"
                                                    for k, s in specs.items()))
        self.logged_sharding = True

    def _shard(self, value: Any) -> Any:
        """Shard every other batch tensor (token ids, sizes) over the data axis too."""
        import torch_xla.distributed.spmd as xs

        if isinstance(value, (Batch, Geometry, ReferenceImages)):
            return replace(value, **{f.name: self._shard(getattr(value, f.name)) for f in fields(value)})
        if isinstance(value, dict):
            return {k: self._shard(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self._shard(v) for v in value)
        if isinstance(value, torch.Tensor) and value.dim() in (1, 2, 3):
            xs.mark_sharding(value, self.mesh, _batch_spec(value))
        return value

    def after_backward(self) -> None:
        import torch_xla

        torch_xla.sync()

    def after_step(self, step: int) -> None:
        import torch_xla

        torch_xla.sync()
        x = self.cfg.xla
        if x.profile_dir and step == x.profile_start_step - 1:
            self._start_trace()
        elif self.tracing and step == x.profile_start_step + x.profile_steps - 1:
            self._stop_trace()

    def _start_trace(self) -> None:
        import torch_xla.debug.profiler as xp

        Path(self.cfg.xla.profile_dir).mkdir(parents=True, exist_ok=True)
        xp.start_trace(str(self.cfg.xla.profile_dir))
        self.tracing = True
        log.info("xla: profiling steps %d-%d into %s", self.cfg.xla.profile_start_step,
                 self.cfg.xla.profile_start_step + self.cfg.xla.profile_steps - 1, self.cfg.xla.profile_dir)

    def _stop_trace(self) -> None:
        import torch_xla.core.xla_model as xm
        import torch_xla.debug.profiler as xp

        xm.wait_device_ops()
        xp.stop_trace()
        self.tracing = False
        log.info("xla: profile written to %s (tensorboard --logdir %s)", self.cfg.xla.profile_dir,
                 self.cfg.xla.profile_dir)

    def finish(self, trained: dict[str, torch.nn.Module]) -> None:
        """The trained modules back on the host, where saving and the final validation run."""
        import torch_xla.core.xla_model as xm

        xm.wait_device_ops()
        for module in trained.values():
            module.to("cpu")

    def close(self) -> None:
        if self.tracing:
            self._stop_trace()
