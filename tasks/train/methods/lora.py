"""LoRA (Hu et al. 2021) with peft: low-rank adapters on the denoiser's attention projections (its
`denoiser.lora_targets`), and on the text encoders' with `train_text_encoder`, as diffusers'
train_dreambooth_lora*.py add them.
`lora_type` picks peft's layer: LoRA, DoRA, LoKr or LoHa (tasks/common/adapters.py); on a quantized
base (`base_model_precision`, tasks/common/quantize.py) the adapters train over 8- or 4-bit layers.

The base weights stay frozen in the training precision; only the adapters train, in float32.
Saves `pytorch_lora_weights.safetensors` (diffusers' format: `pipe.load_lora_weights(folder)`
loads it) and, with `fuse_lora`, the base pipeline with the adapters fused in next to it, so the
`export` stage gets the full pipeline it needs. With a `lora_format` that writes a file of its own
(tasks/common/adapter_formats.py; `comfyui`: every adapter type as one file under ComfyUI's keys,
`comfyui_lora.safetensors`, tasks/common/comfyui_lora.py), that file too.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from finetune_runtime.adapters import apply_peft
from finetune_runtime.layout import LORA_WEIGHTS as WEIGHT_NAME
from finetune_runtime.layout import PEFT_DIR
from tasks.common import families, stream_fuse
from tasks.common.adapter_formats import adapter_format
from tasks.common.adapters import adapter_type, peft_config, save_peft_adapters
from tasks.common.lora import fuse_lora_file
from tasks.common.quantize import is_quantized
from tasks.train.config import TrainConfig
from tasks.train.methods.base import TrainingMethod

log = logging.getLogger(__name__)


class LoRA(TrainingMethod):
    name = "lora"

    def __init__(self, cfg: TrainConfig) -> None:
        super().__init__(cfg)
        self.fused_components: list[str] = []  # the pipeline components the saved file has layers for

    def _config(self, targets: tuple[str, ...]) -> Any:
        c = self.cfg
        return peft_config(c.lora_type, c.rank, c.lora_alpha, c.lora_dropout, list(targets), c.decompose_factor)

    @property
    def diffusers_format(self) -> bool:
        """LoRA and DoRA: diffusers' LoRA file; LoKr and LoHa: peft's folders (tasks/common/adapters.py)."""
        return adapter_type(self.cfg.lora_type).diffusers_file

    def configure(self) -> None:
        """Freeze every base weight, then add adapters (their weights are the only trainable ones)."""
        c = self.components
        for module in c.modules.values():
            module.requires_grad_(False)
            module.eval()
        c.denoiser.add_adapter(self._config(c.family.denoiser.lora_targets))
        c.denoiser.train()
        if self.cfg.train_text_encoder:
            for name in c.trainable_text_encoder_names():
                c.modules[name].add_adapter(self._config(c.family.text.lora_targets))
                c.modules[name].train()
        self._checkpointing()

    def denoiser_load_dtype(self, dtype: torch.dtype, device: torch.device) -> torch.dtype | None:
        """The denoiser's own weights stay frozen: loaded straight into the training precision."""
        return dtype if dtype != torch.float32 else None

    def place(self, device: torch.device, dtype: torch.dtype) -> None:
        """Everything frozen in the low precision, including the base weights under the adapters;
        the adapters in float32 (peft creates them in their base layer's precision, so on a base
        loaded in bf16 they start in bf16, as in diffusers' scripts before `cast_training_params`)."""
        super().place(device, dtype)
        if dtype == torch.float32:
            return
        for name in self.trainable():
            for param in self.components.modules[name].parameters():
                if not is_quantized(param):  # a quantized base's weights keep their format
                    param.data = param.data.to(torch.float32 if param.requires_grad else dtype)

    def save(self, base: Path, out_dir: Path, trained: dict[str, torch.nn.Module]) -> None:
        """The adapters of the trained modules: diffusers' LoRA file, or peft's folders (LoKr, LoHa)."""
        from peft.utils import get_peft_model_state_dict

        family = self.components.family  # the pipeline's components that carry LoRA layers, for fuse_lora
        self.fused_components = [family.denoiser.name, *(n for n in trained if n in family.text.encoder_names)]
        self.save_format_file(out_dir, trained)
        if not self.diffusers_format:
            save_peft_adapters(out_dir / PEFT_DIR, trained)
            log.info("saved %s adapters (%s, rank %d) to %s", self.cfg.lora_type, ", ".join(sorted(trained)),
                     self.cfg.rank, out_dir / PEFT_DIR)
            return
        layers: dict[str, Any] = {}
        for name, module in trained.items():
            layers[f"{name}_lora_layers"] = _diffusers_keys(get_peft_model_state_dict(module))
            # peft keeps target_modules as a set: sort it, or the file's bytes vary with the hash seed.
            config = module.peft_config["default"].to_dict()
            meta = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}
            layers[f"{name}_lora_adapter_metadata"] = meta
        self.components.family.pipeline.diffusers_class().save_lora_weights(
            out_dir, **layers, weight_name=WEIGHT_NAME, safe_serialization=True)
        log.info("saved %s weights (%s, rank %d) to %s", self.cfg.lora_type, ", ".join(sorted(trained)),
                 self.cfg.rank, out_dir / WEIGHT_NAME)

    def save_format_file(self, out_dir: Path, trained: dict[str, torch.nn.Module]) -> None:
        """The file `lora_format` adds beside the adapter files, if any (`comfyui`: the adapters
        also as one file under ComfyUI's keys, tasks/common/comfyui_lora.py)."""
        c = self.cfg
        fmt = adapter_format(c.lora_format)
        if fmt.file is None or fmt.writer is None:
            return
        path = out_dir / fmt.file
        layers = fmt.writer(path, self.components.family, trained, c.lora_type, c.rank, c.lora_alpha)
        log.info("saved %s (%d layers) as lora_format %s to %s", c.lora_type, layers, fmt.name, path)

    def complete_output(self, base: Path, out_dir: Path) -> None:
        """With `fuse_lora`: the base with the LoRA file fused in, once the trained model is gone. A
        LoRA or DoRA file streams into the base's shards (tasks/common/stream_fuse.py: one shard in
        memory, not the whole base); peft's LoKr and LoHa fuse in a pipeline loaded whole."""
        if not self.cfg.fuse_lora:
            return
        if self.diffusers_format:
            fuse, why = stream_fuse.plan(Path(base), out_dir / WEIGHT_NAME, self.fused_components)
            if fuse is not None:
                stream_fuse.fuse_to(Path(base), out_dir, fuse)
                log.info("saved the base pipeline with the LoRA fused in to %s", out_dir)
                return
            log.info("fusing in memory: %s", why)
        self.fuse_in_memory(base, out_dir)

    def fuse_in_memory(self, base: Path, out_dir: Path) -> None:
        """The base pipeline loaded whole, the adapters fused by diffusers (LoRA, DoRA) or peft."""
        from diffusers import DiffusionPipeline

        # In the precision the base is stored in (a bf16 SD3.5 stays bf16, not float32 at twice the size).
        pipe = DiffusionPipeline.from_pretrained(base, dtype=families.stored_dtypes(base))
        if self.diffusers_format:
            fuse_lora_file(pipe, out_dir / WEIGHT_NAME, self.fused_components)
        else:
            apply_peft(pipe, out_dir / PEFT_DIR)
        pipe.save_pretrained(out_dir, safe_serialization=True)
        log.info("saved the base pipeline with the LoRA fused in to %s", out_dir)

    def load_output(self, out_dir: Path, base: Path) -> Any:
        from diffusers import DiffusionPipeline

        if self.cfg.fuse_lora:
            return DiffusionPipeline.from_pretrained(out_dir)
        pipe = DiffusionPipeline.from_pretrained(base)
        if self.diffusers_format:
            pipe.load_lora_weights(out_dir, weight_name=WEIGHT_NAME)
        else:
            apply_peft(pipe, out_dir / PEFT_DIR)  # fused: same images
        return pipe


def _diffusers_keys(state: dict[str, Any]) -> dict[str, Any]:
    """peft's adapter keys in diffusers' names, where diffusers has a name for every one of them.

    diffusers renames only the attention projections it knows (to_q, q_proj, ...); other targets
    (FLUX.2's fused `to_qkv_mlp_proj`) keep peft's `lora_A`/`lora_B`, and a file half in each
    format loads wrong: the loader picks the format from the first key and drops the other half.
    Such a module's keys stay all in peft's format, which every diffusers LoRA loader reads.
    """
    from diffusers.utils import convert_state_dict_to_diffusers

    converted = convert_state_dict_to_diffusers(state)
    if any(".lora_A." in k or ".lora_B." in k for k in converted):
        return state
    return converted
