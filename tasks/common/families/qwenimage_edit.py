"""Qwen-Image-Edit (2511): Qwen-Image editing one or more input images (QwenImageEditPlusPipeline).

The denoiser, the VAE and the objective are Qwen-Image's (qwenimage.py). Two things differ, both
read from QwenImageEditPlusPipeline (diffusers 0.40.0) and done the same way here:

- The text encoder sees the input images. Each prompt goes into the edit template after one
  "Picture k: <|vision_start|><|image_pad|><|vision_end|>" per image; Qwen2.5-VL's processor
  expands each image's pad token to its vision tokens (the image scaled to about 384x384,
  `CONDITION_PIXELS`, sides multiples of 32), and the first 64 tokens (the system turn) are dropped.
  So the conditioning of a target depends on its references: `encode_batch_text` takes them, and
  training does not cache text embeddings for this family (its conditioner's `sees_references`).
- Each input image is scaled to about a megapixel (`REFERENCE_PIXELS`, sides multiples of 32),
  smaller ones up too, encoded (the posterior's mode, normalised as the targets), packed 2x2, and
  its tokens join the transformer's sequence after the noisy target's, with one `img_shapes` entry
  each; the prediction is read from the target's tokens. `inputs.pixels` scales a training
  reference as the pipeline scales an input image.

Loading: transformers' Qwen2VLProcessor (5.15.1) holds a video processor that needs torchvision,
which this stack cannot install; the base stage names finetune_runtime.vl_processor's image-only
processor in model_index.json instead (`pipeline.prepare`), the same files read the same way.

The call: the pipeline makes a megapixel image when given no size; every call here passes the size
finetune_runtime/size.py decides (an edit at its input image's size, as for the other edit
families). The pipeline takes one prompt per call and cannot make an image without an input image
(`CallConvention.min_input_images`).

Not here: an OpenVINO export (optimum-intel 2.2.0 has OVQwenImagePipeline only:
`export.enabled: false`, the registered version served by diffusers), run-time adapters, textual
inversion, prior preservation (class images have no input images).
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from finetune_runtime.convention import MAX_INPUT_IMAGES, CallConvention
from tasks.common.families.denoiser import PredictInputs
from tasks.common.families.input_images import InputImages
from tasks.common.families.pipeline_classes import PipelineClasses
from tasks.common.families.qwenimage import (
    QwenImage,
    QwenImageDenoiser,
    QwenVLText,
    _latent_statistics,
    tiny_qwen25vl,
    tiny_transformer,
)
from tasks.common.families.tiny import qwen_tokenizer, seeded

#: QwenImageEditPlusPipeline's prompt_template_encode, its start index, and the per-image prefix
_TEMPLATE = ("<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, "
             "objects, background), then explain how the user's text instruction should alter or modify the image. "
             "Generate a new image that meets the user's requirements while maintaining consistency with the original "
             "input where appropriate.<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n")
_DROP = 64
_PICTURE = "Picture {}: <|vision_start|><|image_pad|><|vision_end|>"
#: the pipeline's CONDITION_IMAGE_SIZE and VAE_IMAGE_SIZE (pixels an input image is scaled to)
CONDITION_PIXELS = 384 * 384
REFERENCE_PIXELS = 1024 * 1024
_VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")
#: the system turn's words, learned whole by the tiny tokenizer so that it is 64 tokens, as in Qwen's
_SYSTEM_WORDS = ("system", "Describe", "Ġkey", "Ġfeatures", "Ġinput", "Ġimage", "Ġcolor", "Ġshape", "Ġsize",
                 "Ġtexture", "Ġobjects", "Ġbackground", "Ġthen", "Ġexplain", "Ġhow", "Ġuser's", "Ġinstruction",
                 "Ġshould", "Ġalter", "Ġmodify", "Generate", "Ġnew", "Ġmeets", "Ġrequirements", "Ġwhile",
                 "Ġmaintaining", "Ġconsistency", "Ġoriginal", "Ġwhere", "Ġappropriate")


def area_size(width: int, height: int, pixels: int) -> tuple[int, int]:
    """(width, height) of about `pixels` at the ratio width / height, sides rounded to multiples of
    32 (the pipeline's calculate_dimensions)."""
    ratio = width / height
    new_width = math.sqrt(pixels * ratio)
    return round(new_width / 32) * 32, round(new_width / ratio / 32) * 32


def _to_pil(pixels: Any) -> Any:
    """A CHW tensor in [-1, 1] as an RGB image (what the pipeline receives as an input image)."""
    from PIL import Image

    array = ((pixels.detach().float().cpu().clamp(-1, 1) + 1) * 127.5).round().byte().permute(1, 2, 0).numpy()
    return Image.fromarray(array)


class _Text(QwenVLText):
    """Qwen2.5-VL reading each prompt with its input images, as QwenImageEditPlusPipeline does."""

    def tokenize(self, components: Any, prompts: list[str], max_sequence_length: int | None = None) -> list[Any]:
        """Nothing: a prompt is tokenized with its input images' vision tokens (`encode_batch_text`)."""
        return []

    def encode_batch_text(self, components: Any, prompts: list[str], input_ids: list[Any],
                          text_encoders: list[Any] | None = None, references: list[Any] | None = None
                          ) -> tuple[Any, Any]:
        """(hidden, mask) as QwenImageEditPlusPipeline._get_qwen_prompt_embeds makes them for each row's
        prompt and input images (`references`: per reference index, the rows' pixels (n, 3, H, W) in
        [-1, 1]), padded with zeros to the batch's longest; the mask a float (n, L) (qwenimage.py)."""
        import torch
        from diffusers.image_processor import VaeImageProcessor

        if not references:
            raise ValueError(f"{self.title} conditions its text on input images; this batch has none")
        (qwen,) = text_encoders or components.text_encoders
        processor = components.tokenizers[0]
        resize = VaeImageProcessor().resize
        rows = []
        for i, prompt in enumerate(prompts):
            images = []
            for ref in references:
                image = _to_pil(ref[i])
                width, height = area_size(*image.size, CONDITION_PIXELS)
                images.append(resize(image, height, width))
            text = _TEMPLATE.format("".join(_PICTURE.format(k + 1) for k in range(len(images))) + prompt)
            inputs = processor(text=[text], images=images, padding=True, return_tensors="pt").to(
                next(qwen.parameters()).device)
            hidden = qwen(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                          pixel_values=inputs["pixel_values"].to(next(qwen.parameters()).dtype),
                          image_grid_thw=inputs["image_grid_thw"], output_hidden_states=True).hidden_states[-1]
            rows.append(hidden[0, inputs["attention_mask"][0].bool()][_DROP:])
        longest = max(r.shape[0] for r in rows)
        hidden = torch.stack([torch.cat([r, r.new_zeros(longest - r.shape[0], r.shape[1])]) for r in rows])
        mask = torch.stack([(torch.arange(longest, device=hidden.device) < r.shape[0]).to(hidden.dtype)
                            for r in rows])
        return hidden, mask


class _Denoiser(QwenImageDenoiser):
    """Qwen-Image's call with each reference's tokens after the target's."""

    def predict(self, denoiser: Any, noisy_latents: Any, timesteps: Any, hidden: Any, pooled: Any,
                inputs: PredictInputs) -> Any:
        """The target's tokens, then each reference's (qwenimage.py's `predict` with `img_shapes`
        naming every image); the prediction read from the target's tokens."""
        import torch
        from diffusers import QwenImageEditPlusPipeline as Pipe

        b, c, h, w = noisy_latents.shape
        tokens = [Pipe._pack_latents(noisy_latents, b, c, h, w)]
        shapes = [(1, h // 2, w // 2)]
        for reference in inputs.references or []:
            rb, rc, rh, rw = reference.shape
            tokens.append(Pipe._pack_latents(reference.to(noisy_latents.device, noisy_latents.dtype), rb, rc, rh, rw))
            shapes.append((1, rh // 2, rw // 2))
        pred = denoiser(hidden_states=torch.cat(tokens, dim=1), timestep=timesteps / 1000, encoder_hidden_states=hidden,
                        encoder_hidden_states_mask=pooled, img_shapes=[shapes] * b, return_dict=False)[0]
        return Pipe._unpack_latents(pred[:, : tokens[0].shape[1]], h, w, 1)[:, :, 0]


class _Pipeline(PipelineClasses):
    def prepare(self, folder: Any) -> None:
        """model_index.json's processor as finetune_runtime.vl_processor's (the hub's names transformers'
        Qwen2VLProcessor, which cannot load without torchvision); its files are the same."""
        import json
        from pathlib import Path

        path = Path(folder) / "model_index.json"
        index = json.loads(path.read_text())
        entry = ["finetune_runtime.vl_processor", "ImageQwen2VLProcessor"]
        if index.get("processor") not in (None, entry):
            path.write_text(json.dumps({**index, "processor": entry}, indent=2) + "\n")


class _Inputs(InputImages):
    """Up to four input images, at least one; each scaled to about a megapixel before the VAE."""

    def pixels(self, pixels: Any) -> Any:
        """A reference (1, 3, H, W) in [-1, 1] scaled as the pipeline scales an input image before its
        VAE: to about a megapixel at its ratio (VaeImageProcessor.preprocess of the PIL image)."""
        from diffusers.image_processor import VaeImageProcessor

        image = _to_pil(pixels[0])
        width, height = area_size(*image.size, REFERENCE_PIXELS)
        return VaeImageProcessor().preprocess(image, height, width).to(pixels.device, pixels.dtype)


class QwenImageEdit(QwenImage):
    name = "qwenimage-edit"
    title = "Qwen-Image-Edit"
    builtin = "builtin:tiny-qwenimage-edit"
    pipeline = _Pipeline(("QwenImageEditPlusPipeline",))
    # optimum-intel 2.2.0 exports Qwen-Image's text-to-image pipeline only
    export = replace(QwenImage.export, ov_pipeline=None)
    # Qwen2VLProcessor (the tokenizer and the image processor together); its text sees the references
    text = _Text(tokenizer_names=("processor",), trainable=(), max_sequence_length=QwenImage.text.max_sequence_length,
                 sees_references=True, frozen_because=QwenImage.text.frozen_because, trains_embeddings=False)
    denoiser = _Denoiser(guidance_in_batch=False, takes_guidance_scale=False)
    inputs = _Inputs(most=MAX_INPUT_IMAGES, least=1, trains=True)

    @classmethod
    def call_convention(cls) -> CallConvention:
        return replace(super().call_convention(), input_pixels=REFERENCE_PIXELS)

    @classmethod
    def build_tiny(cls, seed: int) -> Any:
        """Qwen-Image's tiny transformer; a 16-wide 3D VAE downsampling 8x (as the real one: a
        megapixel input image is 4096 tokens); a 2-layer Qwen2.5-VL 16 wide whose 1-block vision tower
        runs here; Qwen2VLProcessor over the tiny tokenizer with the vision tokens."""
        from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageEditPlusPipeline
        from tokenizers import AddedToken
        from transformers import Qwen2VLImageProcessorPil

        from finetune_runtime.vl_processor import ImageQwen2VLProcessor

        tokenizer = qwen_tokenizer(max_length=1024 + _DROP, extra_words=_SYSTEM_WORDS)
        tokenizer.add_tokens([AddedToken(t, special=True) for t in _VISION_TOKENS], special_tokens=True)
        processor = ImageQwen2VLProcessor(image_processor=Qwen2VLImageProcessorPil(), tokenizer=tokenizer,
                                          chat_template=tokenizer.chat_template)
        transformer = tiny_transformer(seed)
        vae = seeded(seed + 1, lambda: AutoencoderKLQwenImage(
            base_dim=16, z_dim=4, dim_mult=[1, 2, 2, 4], num_res_blocks=1, temperal_downsample=[False, True, True],
            **_latent_statistics(seed + 1, 4)))
        ids = dict(zip(("vision_start_token_id", "image_token_id", "vision_end_token_id"),
                       tokenizer.convert_tokens_to_ids(list(_VISION_TOKENS))))
        text_encoder = tiny_qwen25vl(seed + 2, tokenizer, 4096, **ids)
        scheduler = FlowMatchEulerDiscreteScheduler(  # Qwen/Qwen-Image-Edit-2511's scheduler config
            shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9, base_image_seq_len=256,
            max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential")
        return QwenImageEditPlusPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                                         processor=processor, transformer=transformer)
