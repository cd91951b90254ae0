"""A family's export profile: how its fine-tune leaves training, one of the roles a family is built from.

Everything the export, the run-time adapters and the adapter files ask of a family sits here, in
one record per family (`ModelFamily.export`): optimum-intel's pipeline class, the key prefixes of
the adapter file OpenVINO GenAI applies at run time, the ComfyUI file's prefixes and module paths,
the axes a static OpenVINO pipeline leaves free for an edit's input images, and the original
single-file layout. A family whose export differs in behaviour (FLUX.2's ComfyUI names, SD's
single file) subclasses `ExportProfile` in its own module; one that differs only in values
`replace`s its parent's profile:

    export = replace(FlowMatchingFamily.export, ov_pipeline="OVZImagePipeline")

`title` is the family's, set by `ModelFamily` for the profile's messages.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: SD's and SDXL's kohya prefixes for ComfyUI (the interface's default)
KOHYA_COMFYUI = {"unet": "lora_unet_", "text_encoder": "lora_te_"}


@dataclass(frozen=True)
class ExportProfile:
    """The export facts of one family; methods hold what differs in behaviour."""

    #: optimum-intel's pipeline class name for the OpenVINO export (None: it has none for this family)
    ov_pipeline: str | None
    #: kohya key prefix of each component's LoRA in the adapter file OpenVINO GenAI applies at run
    #: time (export.adapters: runtime); None: not checked against GenAI, the export refuses it
    genai_lora_prefixes: dict[str, str] | None = None
    #: key prefix of each component's layers in the ComfyUI adapter file (`train.lora_format: comfyui`,
    #: tasks/common/comfyui_lora.py): one ending in "_" takes the module path with "_" for "." (kohya's
    #: `lora_unet_down_blocks_0_...`), one ending in "." the dotted path (`diffusion_model.layers.0...`);
    #: None: ComfyUI cannot load this family (it has no such model), and `lora_format: comfyui` is refused
    comfyui_lora_prefixes: dict[str, str] | None = field(default_factory=lambda: dict(KOHYA_COMFYUI))
    #: the same for LoKr and LoHa where they differ (LyCORIS' and SimpleTuner's `lycoris_`); None: as LoRA
    comfyui_lycoris_prefixes: dict[str, str] | None = None
    #: the family's title, for messages (ModelFamily sets it)
    title: str = "this model family"

    def ov_pipeline_class(self) -> type:
        """optimum-intel's pipeline class, or a UserError saying what to set where there is none."""
        import optimum.intel

        if self.ov_pipeline is None:
            from tasks.common.errors import UserError

            raise UserError(f"export: optimum-intel has no OpenVINO pipeline for {self.title}; set export.enabled: "
                            "false (evaluate and the registered version then run the PyTorch fine-tune)")
        return getattr(optimum.intel, self.ov_pipeline)

    def comfyui_prefixes(self, lora_type: str) -> dict[str, str] | None:
        """The ComfyUI file's prefix per component for an adapter type (None: ComfyUI has no such model)."""
        if self.comfyui_lora_prefixes is None:
            return None
        from tasks.common.adapters import adapter_type

        lycoris = adapter_type(lora_type).lycoris and self.comfyui_lycoris_prefixes is not None
        return self.comfyui_lycoris_prefixes if lycoris else self.comfyui_lora_prefixes

    def comfyui_layers(self, component: str, layers: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """A component's adapter layers ({module path: {ComfyUI suffix: tensor}}, alpha included) under
        the module paths ComfyUI's model has, where they differ from diffusers' (FLUX.2's)."""
        return layers

    def free_reference_axes(self, ov_pipe: Any) -> None:
        """Free the axes of a statically reshaped OpenVINO pipeline that an edit's input images
        change (a family that takes references); nothing for one that does not."""

    def single_file_refusal(self, index: dict[str, Any]) -> str | None:
        """Why a pipeline (its model_index.json) cannot be written as one original-layout file, or None."""
        return f"{self.title} has no original single-file layout here; set export.single_file: none"

    def single_file_layout(self, pipe: Any) -> str:
        """The original single-file checkpoint layout of `pipe` ('sd1', 'sd2', 'sdxl')."""
        raise NotImplementedError(self.single_file_refusal({}))
