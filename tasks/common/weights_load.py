"""Loading a diffusers model straight into a lower precision, a few tensors at a time.

`from_pretrained(dtype=...)` maps the whole safetensors file and casts from that mapping:
every page of the file is resident beside the cast copy until the load ends. For SD 1.5's UNet
(3.4 GB in float32) loaded into bf16 that is a 5.3 GB peak for a 1.7 GB result, and the peak of
a LoRA or textual inversion run, whose denoiser is frozen. Opening the file again for every chunk
of tensors lets each chunk's pages go once they are cast: 2.6 GB (the UNet alone, under tcmalloc;
in the train stage a LoRA run's peak went from 6.0 to 3.3 GB at 256 px, benchmarks/train/README.md).
Same weights, same dtypes (tests/common/test_weights_load.py).

Anything this reader does not cover exactly (no safetensors files, modules kept in float32, keys
that do not match the model's) goes through `from_pretrained` as before.

With a quantized base (`quantize`, tasks/common/quantize.py) each Linear layer is quantized as
soon as its chunk has loaded, so the peak stays near the quantized size plus one chunk, never the
whole model in the load precision. The freed load-precision weights go back to the system after
each chunk: under the train stage's tuned glibc (mmap off, no trimming; tasks/common/allocator.py)
they stayed mapped and were not reused, and FLUX.1-dev's int8 load grew by 2.7 bytes a parameter,
past this machine's 24 GB, instead of 0.9 (benchmarks/flux_dev/README.md).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from tasks.common.memory import release_memory, return_free_heap

log = logging.getLogger(__name__)

CHUNK = 64  # tensors per mapping of the file: SD 1.5's UNet has 686, the largest 59 MB


def load_in_dtype(cls: Any, base: Path, subfolder: str, dtype: torch.dtype, quantize: Any = None) -> Any:
    """`cls.from_pretrained(base, subfolder=subfolder, dtype=dtype)`, with a lower peak;
    `quantize` (a BasePrecision): its Linear layers quantized as they load. `cls`: a diffusers model
    class, or a transformers one (a frozen text encoder: its tied weights are tied after the load)."""
    transformers_model = hasattr(cls, "config_class")
    files = _safetensors_files(Path(base) / subfolder, "model" if transformers_model else "diffusion_pytorch_model")
    keep_fp32 = _kept_in_fp32(cls, dtype) if transformers_model else []
    if (dtype == torch.float32 and quantize is None) or not files or (
            getattr(cls, "_keep_in_fp32_modules", None) and not transformers_model):
        return _whole(cls, base, subfolder, dtype, quantize)
    model = _empty_model(cls, base, subfolder, transformers_model)
    keys = _stored_keys(files)
    stored, wanted = {k for names in keys.values() for k in names}, set(model.state_dict())
    if not stored <= wanted or (stored != wanted and not transformers_model):
        log.info("%s: keys differ from the model's, loading with from_pretrained", subfolder)
        return _whole(cls, base, subfolder, dtype, quantize)  # renamed or missing keys
    for path, names in keys.items():
        for start in range(0, len(names), CHUNK):
            _load_chunk(model, path, names[start : start + CHUNK], dtype, keep_fp32)
            if quantize is not None:
                quantize.quantize(model, _loaded_linears(model), dtype)
                return_free_heap()  # the chunk's bf16 weights, now int8/nf4: see the module's docstring
    if transformers_model:
        model.tie_weights()  # T5's encoder.embed_tokens is stored once, as shared
        if any(t.is_meta for t in model.state_dict().values()):
            log.info("%s: tensors the files do not hold, loading with from_pretrained", subfolder)
            del model
            release_memory()
            return _whole(cls, base, subfolder, dtype, quantize)
    else:
        model.register_to_config(_name_or_path=base)  # as from_pretrained records it
    return model.eval()


def _empty_model(cls: Any, base: Path, subfolder: str, transformers_model: bool) -> Any:
    """The model built from its config on the meta device (no memory)."""
    from accelerate import init_empty_weights

    with init_empty_weights():
        if transformers_model:
            return cls(cls.config_class.from_pretrained(base, subfolder=subfolder))
        return cls.from_config(cls.load_config(base, subfolder=subfolder))


def _stored_keys(files: list[Path]) -> dict[Path, list[str]]:
    """Each weight file's tensor names, in file order."""
    from safetensors import safe_open

    keys: dict[Path, list[str]] = {}
    for path in files:
        with safe_open(path, "pt") as fh:
            keys[path] = list(fh.keys())
    return keys


def _kept_in_fp32(cls: Any, dtype: torch.dtype) -> list[str]:
    """The modules transformers' from_pretrained keeps in float32 at `dtype`: `_keep_in_fp32_modules`
    in float16 only, `_keep_in_fp32_modules_strict` in float16 and bfloat16."""
    keep = list(getattr(cls, "_keep_in_fp32_modules_strict", None) or []) if dtype in (
        torch.float16, torch.bfloat16) else []
    return keep + list(getattr(cls, "_keep_in_fp32_modules", None) or []) if dtype == torch.float16 else keep


def _whole(cls: Any, base: Path, subfolder: str, dtype: torch.dtype, quantize: Any) -> Any:
    """from_pretrained, then quantized whole (the peak is the model in `dtype`)."""
    model = cls.from_pretrained(base, subfolder=subfolder, dtype=dtype)
    if quantize is not None:
        log.info("%s: quantized after a whole load (the chunked reader does not cover this model)", subfolder)
        quantize.quantize(model, None, dtype)
    return model


def _loaded_linears(model: torch.nn.Module) -> list[str]:
    """Plain Linear layers whose every tensor has loaded (none left on the meta device)."""
    return [name for name, module in model.named_modules() if type(module) is torch.nn.Linear
            and not any(t.is_meta for t in module.parameters())]


def _load_chunk(model: torch.nn.Module, path: Path, names: list[str], dtype: torch.dtype,
                keep_fp32: list[str] = ()) -> None:  # type: ignore[assignment]
    """Cast one chunk of a file's tensors into the model (modules named in `keep_fp32` into float32);
    the file's mapping closes (and its pages go) after."""
    from accelerate.utils import set_module_tensor_to_device
    from safetensors import safe_open

    with safe_open(path, "pt") as fh:
        for name in names:  # integer buffers keep their dtype (accelerate casts floating-point values only)
            value = fh.get_tensor(name)
            target = torch.float32 if any(k in name.split(".") for k in keep_fp32) else dtype
            if value.dtype == target or not value.is_floating_point():  # no cast, no copy: the tensor
                value = value.clone()  # would hold the file's mapping open
            set_module_tensor_to_device(model, name, "cpu", value=value, dtype=target)


def stored_dtype(folder: Path, stem: str = "diffusion_pytorch_model") -> torch.dtype | None:
    """The floating-point dtype a model folder's weights are stored in (its first floating tensor's,
    read from the safetensors header), or None when it has no safetensors weights."""
    from safetensors import safe_open

    floats = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    for path in _safetensors_files(Path(folder), stem):
        with safe_open(path, "pt") as fh:
            for name in list(fh.keys()):  # safe_open is not iterable
                if (dtype := fh.get_slice(name).get_dtype()) in floats:
                    return floats[dtype]
    return None


def _safetensors_files(folder: Path, stem: str) -> list[Path]:
    """The model's weight files as from_pretrained reads them (one file, or the shards of an index)."""
    single = folder / f"{stem}.safetensors"
    if single.is_file():
        return [single]
    index = folder / f"{stem}.safetensors.index.json"
    if index.is_file():
        return [folder / name for name in dict.fromkeys(json.loads(index.read_text())["weight_map"].values())]
    return []
