"""A frozen base held in 8 or 4 bits (`train.base_model_precision`), its Linear layers quantized as they load.

Adapters (LoRA, DoRA, LoKr, LoHa) train in float32 on top of the quantized layers, as QLoRA does;
the base's own weights never train, so full fine-tunes and DreamBooth refuse a quantized base.

One library per precision by default, chosen on measurements (benchmarks/quantized/README.md):
`int8` and `fp8` are torchao's weight-only configs, `nf4` is bitsandbytes' 4-bit NormalFloat.
A suffix picks another library: `int8-quanto`, `int8-bnb`, `fp8-quanto`. What each combination
trains with was measured here (`UNSUPPORTED_ADAPTERS`); everything else is refused at config time,
naming the key and what works.

The weights reach no output: the adapters are saved on their own, and a fused output loads the
base again from its files in its stored precision.
"""
from __future__ import annotations

import importlib.util
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch loads in the stage's process only after the launcher (tests/train/test_launch.py)
    import torch

log = logging.getLogger(__name__)

#: precision -> the library used when the value carries no suffix
DEFAULT_LIBRARY = {"int8": "torchao", "fp8": "torchao", "nf4": "bnb"}
#: (precision, library) pairs that exist
COMBINATIONS = {("int8", "torchao"), ("int8", "quanto"), ("int8", "bnb"), ("fp8", "torchao"), ("fp8", "quanto"),
                ("nf4", "bnb")}
PACKAGES = {"torchao": "torchao", "quanto": "optimum-quanto", "bnb": "bitsandbytes"}
MODULES = {"torchao": "torchao", "quanto": "optimum.quanto", "bnb": "bitsandbytes"}
#: adapter types whose peft layers fail on these quantized layers (measured: DoRA cannot read the
#: weight of quanto's or bitsandbytes' 8-bit layers; LoKr/LoHa cannot wrap a packed 4-bit weight)
UNSUPPORTED_ADAPTERS = {("int8", "quanto"): {"dora"}, ("fp8", "quanto"): {"dora"}, ("int8", "bnb"): {"dora"},
                        ("nf4", "bnb"): {"lokr", "loha"}}
#: devices each library quantizes for (XLA's lazy tensors have none of these kernels)
DEVICES = {"torchao": {"cpu", "cuda"}, "quanto": {"cpu", "cuda"}, "bnb": {"cpu", "cuda"}}
CHOICES = ("none", *sorted(DEFAULT_LIBRARY), *sorted(f"{p}-{lib}" for p, lib in COMBINATIONS))


@dataclass(frozen=True)
class BasePrecision:
    """A quantized base: `precision` (int8, fp8, nf4) through `library` (torchao, quanto, bnb)."""

    precision: str
    library: str

    @classmethod
    def parse(cls, value: str, key: str = "base_model_precision") -> BasePrecision | None:
        """None for `none`; ValueError naming the choices (and `key`, the setting it came from) for a
        value that is not one."""
        if value == "none":
            return None
        precision, _, library = value.partition("-")
        library = library or DEFAULT_LIBRARY.get(precision, "")
        if (precision, library) not in COMBINATIONS:
            raise ValueError(f"{key}: {value!r} is not one of {', '.join(CHOICES)}")
        return cls(precision, library)

    @property
    def name(self) -> str:
        return f"{self.precision}-{self.library}"

    def problem(self, device_type: str | None = None, adapter: str | None = None,
                key: str = "base_model_precision", section: str = "train") -> str | None:
        """Why this precision (the value of `section`.`key`) cannot run here (package, device, adapter
        type), or None."""
        setting, key = key, f"{section}.{key}: {self.name}"
        if not _installed(MODULES[self.library]):
            return f"{key} needs the {PACKAGES[self.library]} package (pip install {PACKAGES[self.library]})"
        if device_type is not None and device_type not in DEVICES[self.library]:
            where = " and ".join(sorted(DEVICES[self.library]))
            return f"{key} has no kernels on {device_type}; it runs on {where}: set {setting}: none here"
        if adapter in UNSUPPORTED_ADAPTERS.get((self.precision, self.library), set()):
            return (f"{key} cannot train lora_type: {adapter} (peft's {adapter} layer fails on these quantized "
                    f"layers); with {adapter} use one of {', '.join(choices_for(adapter))}")
        return None

    def quantize(self, model: torch.nn.Module, names: Iterable[str] | None = None, dtype: torch.dtype | None = None
                 ) -> int:
        """Quantize `model`'s plain Linear layers named in `names` (all: None) in place; returns how many
        (layers quantized before are left as they are: torchao keeps the Linear class).
        `dtype`: the precision the layers compute in (nf4's dequantized matmul)."""
        import torch

        wanted = None if names is None else set(names)
        linears = {n: m for n, m in model.named_modules()
                   if type(m) is torch.nn.Linear and not is_quantized(m.weight) and (wanted is None or n in wanted)}
        if not linears:
            return 0
        QUANTIZERS[self.library](model, linears, self.precision, dtype)
        for name in linears:
            model.get_submodule(name).register_forward_pre_hook(_autocast_input)
        return len(linears)


def following_train(section: str, cfg: Any, params: dict[str, Any]) -> Any:
    """`cfg` (class_images' or evaluate's config) with base_model_precision null replaced by params.yaml's
    train.base_model_precision (its default, none, where the train section leaves it out); a UserError
    names both keys for a bad one."""
    from tasks.common.errors import UserError

    if cfg.base_model_precision is not None:
        return cfg
    value = (params.get("train") or {}).get("base_model_precision", "none")
    try:
        BasePrecision.parse(value, key="train.base_model_precision")
    except ValueError as err:
        raise UserError(f"{section}.base_model_precision is null, so it follows {err}") from None
    return cfg.model_copy(update={"base_model_precision": value})


def _autocast_input(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """Autocast's cast for a quantized layer: the kernels of torchao's int8 and bitsandbytes' nf4 bypass
    autocast, and a float32 input (a UNet's timestep embedding) would come out float32 into bf16 layers."""
    import torch

    x = args[0] if args else None
    if isinstance(x, torch.Tensor) and x.is_floating_point() and torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        if x.dtype != dtype:
            return (x.to(dtype), *args[1:])
    return None


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a dotted name whose parent package is missing
        return False


def choices_for(adapter: str) -> list[str]:
    """The base_model_precision values an adapter type trains on."""
    works = []
    for choice in CHOICES:
        base = BasePrecision.parse(choice)
        if base is None or adapter not in UNSUPPORTED_ADAPTERS.get((base.precision, base.library), set()):
            works.append(choice)
    return works


def _torchao(model: torch.nn.Module, linears: dict[str, torch.nn.Module], precision: str, dtype: Any) -> None:
    from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig, quantize_

    config = Int8WeightOnlyConfig() if precision == "int8" else Float8WeightOnlyConfig()
    chosen = {id(m) for m in linears.values()}
    quantize_(model, config, filter_fn=lambda module, fqn: id(module) in chosen)


def _quanto(model: torch.nn.Module, linears: dict[str, torch.nn.Module], precision: str, dtype: Any) -> None:
    from optimum.quanto import freeze, qfloat8, qint8, quantize

    quantize(model, weights=qint8 if precision == "int8" else qfloat8, include=list(linears))
    freeze(model)


def _bnb(model: torch.nn.Module, linears: dict[str, torch.nn.Module], precision: str, dtype: Any) -> None:
    import bitsandbytes as bnb
    import torch

    for name, linear in linears.items():
        args = (linear.in_features, linear.out_features, linear.bias is not None)
        weight = linear.weight.data
        if precision == "int8":
            layer = bnb.nn.Linear8bitLt(*args, has_fp16_weights=False, device="meta")
            layer.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
        else:
            layer = bnb.nn.Linear4bit(*args, compute_dtype=dtype or weight.dtype, quant_type="nf4", device="meta")
            layer.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4")
        if linear.bias is not None:
            layer.bias = torch.nn.Parameter(linear.bias.data, requires_grad=False)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, layer.to(weight.device))  # .to quantizes


QUANTIZERS = {"torchao": _torchao, "quanto": _quanto, "bnb": _bnb}


def is_quantized(tensor: torch.Tensor) -> bool:
    """A quantized weight (a tensor subclass of torchao or quanto, bitsandbytes' Int8Params/Params4bit)."""
    import torch

    return type(tensor) not in (torch.Tensor, torch.nn.Parameter) or type(tensor.data) is not torch.Tensor


def has_quantized(module: torch.nn.Module) -> bool:
    return any(is_quantized(p) for p in module.parameters())


def place_quantized(module: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """`module.to(device, dtype)` for a module with quantized layers: their weights keep their
    format (casting would dequantize or fail), every plain floating-point tensor takes `dtype`."""
    import torch

    for tensor in [*module.parameters(), *module.buffers()]:
        if not is_quantized(tensor) and tensor.is_floating_point():
            tensor.data = tensor.data.to(device, dtype)
    if any(p.device != torch.device(device) for p in module.parameters()):
        for sub in module.modules():
            if any(is_quantized(p) for p in sub.parameters(recurse=False)):
                sub.to(device)

