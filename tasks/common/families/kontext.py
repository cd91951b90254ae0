"""FLUX.1 Kontext: FLUX.1's transformer editing an input image (FluxKontextPipeline).

Everything is FLUX.1's (CLIP-L + T5, packed 16-channel latents, guidance-distilled) but one thing:
the input image's latents, packed like the target's, join the transformer's sequence after the
noisy target's tokens, with position ids whose first coordinate is 1 (FluxKontextPipeline's
prepare_latents); the prediction is read from the target's tokens. Training does the same with
the edit dataset's reference (diffusers' train_dreambooth_lora_flux_kontext.py, v0.40.0).

The call: FluxKontextPipeline rescales any size it is asked for to `max_area` (1024x1024 by
default) and snaps the input image to one of Kontext's preferred resolutions; the call convention
passes the decided size's area and `_auto_resize=False`, so an image is made at the size the
stages and the served model decide (finetune_runtime/size.py) and the input image is encoded at
its own size, as the references trained. One input image per call, as the pipeline takes.

Not here: an OpenVINO export (optimum-intel 2.2.0 has no Kontext pipeline: `export.enabled: false`,
the registered version served by diffusers), run-time adapters, textual inversion.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from finetune_runtime.convention import CallConvention
from tasks.common.families.denoiser import PredictInputs
from tasks.common.families.flux import Flux, FluxDenoiser
from tasks.common.families.input_images import InputImages
from tasks.common.families.pipeline_classes import PipelineClasses


class _Denoiser(FluxDenoiser):
    """FLUX.1's call with the reference's tokens after the target's."""

    def image_tokens(self, latents: Any, inputs: PredictInputs) -> tuple[Any, Any]:
        """The target's tokens, then the reference's, its position ids' first coordinate 1."""
        import torch
        from diffusers import FluxKontextPipeline

        packed, img_ids = super().image_tokens(latents, inputs)
        for reference in inputs.references or []:
            reference = reference.to(packed.device, packed.dtype)
            b, c, h, w = reference.shape
            tokens = FluxKontextPipeline._pack_latents(reference, b, c, h, w)
            ids = FluxKontextPipeline._prepare_latent_image_ids(b, h // 2, w // 2, packed.device, packed.dtype)
            ids[..., 0] = 1
            packed, img_ids = torch.cat([packed, tokens], dim=1), torch.cat([img_ids, ids], dim=0)
        return packed, img_ids


class FluxKontext(Flux):
    name = "kontext"
    title = "FLUX.1 Kontext"
    builtin = "builtin:tiny-flux-kontext"
    pipeline = PipelineClasses(("FluxKontextPipeline",))
    export = replace(Flux.export, ov_pipeline=None)  # optimum-intel 2.2.0 exports no Kontext pipeline
    inputs = InputImages(most=1, trains=True)  # FluxKontextPipeline takes one input image
    denoiser = _Denoiser(guidance_in_batch=False)

    @classmethod
    def call_convention(cls) -> CallConvention:
        return replace(super().call_convention(), area_argument="max_area",
                       arguments={"_auto_resize": False})

    @classmethod
    def build_tiny(cls, seed: int) -> Any:
        """FLUX.1's tiny components (tasks/common/families/flux.py) as a Kontext pipeline."""
        from diffusers import FluxKontextPipeline

        return FluxKontextPipeline(**Flux.build_tiny(seed).components)
