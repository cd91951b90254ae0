"""OpenVINO GenAI's Text2ImagePipeline: one compiled base export, LoRA adapters applied per call.

`export.adapters: runtime` exports the base once and keeps each fine-tune's LoRA beside it, in the
form GenAI's `Adapter` reads; the export's parity gate and the evaluate stage generate through
here. Three things GenAI needs that optimum-intel's export does not give:

- OpenVINO tokenizers (`tokenizer/openvino_tokenizer.xml`): GenAI tokenizes in OpenVINO;
  `OVDiffusionPipeline.from_pretrained(export=True)` does not convert them (optimum's own
  `export_tokenizer` does, called here);
- the LoRA in the kohya layout (`lora_unet_<module path with _>.lora_down.weight`, `.lora_up`,
  `.alpha` in float32): GenAI 2026.4 leaves diffusers' `unet.<path>.lora_A` keys unused (it warns
  and generates with the base), and refuses integer alphas ("Not supported safetensors dtype");
- a static shape set by its own `reshape()`: the base is exported with dynamic shapes and GenAI
  fixes them at load, so one folder serves any size.

Adapters compile in MODE_DYNAMIC: the LoRA is a separate branch of each layer, switched, weighted
and blended per `generate()` call without recompiling.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import openvino as ov
import openvino_genai as genai

from tasks.common import families
from tasks.common.openvino_model import StaticShape, precision_config

log = logging.getLogger(__name__)

#: An `export.adapters: runtime` export: the base export's folder, the adapter file (kohya
#: layout, float32) and the JSON that says what the adapter is and which base and shape it goes with.
BASE_DIR = "base"
GENAI_LORA_NAME = "genai_lora.safetensors"
ADAPTER_FILE = "runtime_adapter.json"

def export_tokenizers(pipe: Any, out: Path) -> list[str]:
    """Write each tokenizer of the diffusers pipeline `pipe` as an OpenVINO model into
    `out/<name>/` (beside the HF files the export already has); returns the names written."""
    from optimum.exporters.openvino.convert import export_tokenizer

    names = [n for n in families.of_pipeline(pipe).text.tokenizer_names if getattr(pipe, n, None) is not None]
    for name in names:
        export_tokenizer(getattr(pipe, name), Path(out) / name)
    return names


def kohya_lora_state(pipe: Any) -> dict[str, Any]:
    """The LoRA layers peft holds in `pipe` (after `load_lora_weights`) as a kohya state dict.

    peft's scale (alpha / rank, per layer) is folded into `lora_up` and `alpha` set to the rank,
    so GenAI applies exactly what diffusers does, whatever alpha the adapter was trained with.
    """
    from peft.tuners.lora import LoraLayer

    family = families.of_pipeline(pipe)
    if family.export.genai_lora_prefixes is None:
        raise ValueError(f"{family.title}: OpenVINO GenAI's adapters are not supported for it here")
    state: dict[str, Any] = {}
    for component, prefix in family.export.genai_lora_prefixes.items():
        model = getattr(pipe, component, None)
        if model is None:
            continue
        for path, module in model.named_modules():
            if not isinstance(module, LoraLayer):
                continue
            for name in module.active_adapters:
                if name not in module.lora_A:
                    continue
                if module.use_dora.get(name):
                    raise ValueError(f"{component}.{path} is a DoRA layer; GenAI applies plain LoRA only")
                down = module.lora_A[name].weight.detach().float()
                up = module.lora_B[name].weight.detach().float() * float(module.scaling[name])
                key = f"{prefix}_{path.replace('.', '_')}"
                state[f"{key}.lora_down.weight"] = down.contiguous()
                state[f"{key}.lora_up.weight"] = up.contiguous()
                state[f"{key}.alpha"] = down.new_tensor(float(down.shape[0]))
    if not state:
        raise ValueError("the pipeline holds no LoRA layers to write")
    return state


def write_genai_lora(pipe: Any, dst: Path) -> int:
    """Write `pipe`'s LoRA (see kohya_lora_state) to `dst`; returns its number of LoRA layers."""
    from safetensors.torch import save_file

    state = kohya_lora_state(pipe)
    save_file(state, str(dst))
    return sum(1 for k in state if k.endswith(".alpha"))


def load_text2image(export: Path, shape: StaticShape, guidance_scale: float, precision: str,
                    adapters: list[Path] = ()) -> Any:
    """GenAI's pipeline over the base export `export`, reshaped to `shape` and compiled on CPU at
    `precision` ('f32', 'bf16', 'f16', 'auto'), ready for any adapter in MODE_DYNAMIC.

    `adapters` (files in GENAI_LORA_NAME's layout) are known at compile time; others can still be
    passed to generate() (GenAI adds their branches on first use).
    """
    if shape.batch_size != 1:
        raise ValueError("GenAI's Text2ImagePipeline takes one prompt per call (batch_size 1)")
    pipe = genai.Text2ImagePipeline(str(export))
    pipe.reshape(shape.num_images_per_prompt, shape.height, shape.width, guidance_scale)
    config = genai.AdapterConfig([genai.Adapter(str(p)) for p in adapters],
                                 genai.AdapterConfig.Mode.MODE_DYNAMIC)
    pipe.compile("CPU", adapters=config, **precision_config(precision))
    return pipe


def adapter_config(adapters: list[tuple[Any, float]]) -> Any:
    """GenAI's per-call AdapterConfig for (Adapter, weight) pairs; [] is the base alone.

    Zero weights are left out: GenAI 2026.4 given only zero-weight adapters kept applying the
    previous call's adapter (measured: the base's images matched the last adapter's).
    """
    used = [(adapter, float(weight)) for adapter, weight in adapters if weight != 0]
    return genai.AdapterConfig(used) if used else genai.AdapterConfig()


def generate(pipe: Any, prompt: str, shape: StaticShape, steps: int, guidance_scale: float,
             seed: int, adapters: list[tuple[Any, float]]) -> np.ndarray:
    """Images (N, H, W, 3) in [0, 1] for `prompt` through GenAI with `adapters` blended.

    The initial latents come from GenAI's TorchGenerator, which draws what
    `torch.randn(shape, generator=torch.Generator().manual_seed(seed))` draws: a diffusers call
    with that generator starts from the same latents.
    """
    data = genai_call(pipe, prompt, shape, steps, guidance_scale, genai.TorchGenerator(seed), adapters)
    return data.astype(np.float32) / 255.0


def genai_call(pipe: Any, prompt: str, shape: StaticShape, steps: int, guidance_scale: float, generator: Any,
               adapters: list[tuple[Any, float]]) -> np.ndarray:
    """The one call of GenAI's Text2ImagePipeline here: uint8 images (N, H, W, 3) at `shape`."""
    result = pipe.generate(
        prompt, width=shape.width, height=shape.height, num_inference_steps=steps,
        guidance_scale=guidance_scale, num_images_per_prompt=shape.num_images_per_prompt,
        generator=generator, adapters=adapter_config(adapters),
    )
    return np.asarray(result.data)


class _Latents(genai.Generator):
    """A GenAI generator that hands out given initial latents (GenAI's generate() takes no
    `latents`; it asks its generator for noise of the latents' shape)."""

    def __init__(self, latents: np.ndarray) -> None:
        super().__init__()
        self.rows = np.ascontiguousarray(latents, dtype=np.float32)

    def next(self) -> float:  # GenAI's method name
        raise RuntimeError("GenAI asked for scalar noise; only initial latents are given")

    def randn_tensor(self, shape: Any) -> Any:
        if tuple(shape) != self.rows.shape:
            raise RuntimeError(f"GenAI asked for latents {tuple(shape)}, given {self.rows.shape}")
        return ov.Tensor(self.rows)


class GenAIRunner:
    """A GenAI pipeline (base export + adapters, blended by weight) called as the stages call a
    diffusers pipeline: `runner(prompt=[...], latents=..., ...)`, images as PIL or numpy.

    `diffusers_class_name`, `config` and the denoiser's config let the family helpers
    (families.of_pipeline, latent_shape) treat it as the pipeline it was exported from.
    """

    def __init__(self, export: Path, shape: StaticShape, guidance_scale: float, precision: str,
                 adapters: list[tuple[Path, float]]) -> None:
        import json
        from types import SimpleNamespace

        export = Path(export)
        self.config = json.loads((export / "model_index.json").read_text())
        self.diffusers_class_name = self.config["_class_name"]
        family = families.from_index(self.config, str(export))
        denoiser = json.loads((export / family.denoiser.name / "config.json").read_text())
        setattr(self, family.denoiser.name, SimpleNamespace(config=denoiser))
        vae = json.loads((export / "vae_decoder" / "config.json").read_text())
        self.vae_scale_factor = 2 ** (len(vae["block_out_channels"]) - 1)
        self.shape = shape
        self.height, self.width = shape.height, shape.width  # compiled at one size (finetune_runtime/size.py)
        self.pipe = load_text2image(export, shape, guidance_scale, precision, [p for p, _ in adapters])
        self.adapters = [(genai.Adapter(str(p)), w) for p, w in adapters]

    def set_progress_bar_config(self, **_: Any) -> None:
        """GenAI draws no progress bar."""

    def __call__(self, prompt: list[str], latents: Any, num_inference_steps: int, guidance_scale: float,
                 output_type: str = "pil", **_: Any) -> Any:
        from types import SimpleNamespace

        from PIL import Image

        per = self.shape.num_images_per_prompt
        rows = np.asarray(latents, dtype=np.float32)
        out = []
        for i, text in enumerate(prompt):
            out.append(genai_call(self.pipe, text, self.shape, num_inference_steps, guidance_scale,
                                  _Latents(rows[i * per:(i + 1) * per]), self.adapters))
        images = np.concatenate(out)
        if output_type == "pil":
            return SimpleNamespace(images=[Image.fromarray(im) for im in images])
        return SimpleNamespace(images=images.astype(np.float32) / 255.0)


def is_runtime_export(path: Path) -> bool:
    """True for a folder `export.adapters: runtime` wrote (base export + adapter)."""
    return (Path(path) / ADAPTER_FILE).is_file()


def open_runtime_export(path: Path, guidance_scale: float) -> GenAIRunner:
    """A runtime export's base with its own adapter at weight 1, at the shape it was checked at."""
    import json

    path = Path(path)
    info = json.loads((path / ADAPTER_FILE).read_text())
    shape = StaticShape(**info["static_shape"])
    return GenAIRunner(path / BASE_DIR, shape, guidance_scale, "f32", [(path / info["file"], 1.0)])
