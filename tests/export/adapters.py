"""Hand-made train outputs of the adapter methods on the tiny model (no dependence on `train`).

LoRA: peft adapters on the UNet's attention projections with non-zero B matrices (peft's
gaussian init leaves B = 0, a no-op), saved in diffusers' `pytorch_lora_weights.safetensors`
format. Textual inversion: one random embedding row under a new token, in diffusers'
`learned_embeds.safetensors` layout ({token: [1, dim]}).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

TOKEN = "<sks-toy>"


def write_adapters(base: Path, out: Path, lora: bool = True, embeds: bool = True,
                   seed: int = 0, text_encoder: bool = False) -> Path:
    """Adapter files for `base` written into `out` (only the files, no pipeline); `text_encoder`:
    the LoRA has text-encoder layers too (rank 2, alpha 4: a scale of 2)."""
    import torch
    from diffusers import StableDiffusionPipeline
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    pipe = StableDiffusionPipeline.from_pretrained(base)
    generator = torch.Generator().manual_seed(seed)
    if lora:
        targets = ["to_q", "to_k", "to_v", "to_out.0"]
        pipe.unet.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=targets))
        with torch.no_grad():
            for name, param in pipe.unet.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
        layers = convert_state_dict_to_diffusers(get_peft_model_state_dict(pipe.unet))
        extra = {}
        if text_encoder:
            text_targets = ["q_proj", "k_proj", "v_proj", "out_proj"]
            text_config = LoraConfig(r=2, lora_alpha=4, target_modules=text_targets)
            pipe.text_encoder.add_adapter(text_config)
            with torch.no_grad():
                for name, param in pipe.text_encoder.named_parameters():
                    if "lora_B" in name:
                        param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
            extra = {"text_encoder_lora_layers": get_peft_model_state_dict(pipe.text_encoder),
                     "text_encoder_lora_adapter_metadata": text_config.to_dict(),
                     "unet_lora_adapter_metadata": LoraConfig(r=4, lora_alpha=4,
                                                              target_modules=targets).to_dict()}
        StableDiffusionPipeline.save_lora_weights(
            out, unet_lora_layers=layers, weight_name="pytorch_lora_weights.safetensors",
            safe_serialization=True, **extra,
        )
    if embeds:
        dim = pipe.text_encoder.get_input_embeddings().weight.shape[1]
        row = torch.randn(1, dim, generator=generator)
        save_file({TOKEN: row}, out / "learned_embeds.safetensors")
    return out


def lora_images(base: Path, loras: list[Path], weights: list[float], seed: int, steps: int,
                images: int = 1, prompt: str = "a photo of sks toy") -> Any:
    """The PyTorch fine-tune's images at 64 px, guidance 7.5 (LoRAs loaded unfused, blended by
    weight; none: the base), from a CPU generator seeded `seed`: the diffusers twin of a GenAI call."""
    import torch
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(base)
    pipe.set_progress_bar_config(disable=True)
    for i, lora in enumerate(loras):
        pipe.load_lora_weights(lora, adapter_name=f"l{i}")
    if loras:
        pipe.set_adapters([f"l{i}" for i in range(len(loras))], weights)
    return pipe(prompt, num_images_per_prompt=images, height=64, width=64, guidance_scale=7.5,
                num_inference_steps=steps, output_type="np", generator=torch.Generator().manual_seed(seed)).images
