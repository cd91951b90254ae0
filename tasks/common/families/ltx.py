"""LTX-Video: a video DiT (LTXVideoTransformer3DModel) over a causal video VAE's latents
(AutoencoderKLLTXVideo: 32x in space, 8x in time, so clips of 8k+1 frames), one T5 text encoder.

Trains on clips (`video`): ingest's `clips.jsonl` rows, each a folder of frames already sampled to a
frame count and a bucket size (tasks/ingest/README.md, "Video clips"); the pixels are (3, F, H, W)
and the VAE takes them as a batch of 5D clips.

Conditioning (as LTXPipeline.encode_prompt builds it): T5's last hidden state of the prompt padded on
the right to `max_sequence_length` (the pipeline's 128), the ids given to T5 without their mask (as
the pipeline does), and the tokenizer's attention mask, which the transformer's cross-attention reads
(`encoder_attention_mask`): the masked-family convention, `(hidden, mask)` with the float (b, L) mask
in the pooled slot (as Sana).

Latents: the VAE's posterior sample normalised per channel with its `latents_mean` / `latents_std`
buffers times the config's scaling factor (LTXPipeline's `_normalize_latents`, which it undoes before
decoding). The transformer takes them packed into a token sequence (frames x rows x columns, patches
of the config's `patch_size` / `patch_size_t`; 1 in the released models); `predict` packs the 5D
latents, calls it with the latent grid's size and the rotary embedding's interpolation scale, and
unpacks the prediction, so the loss lies on the (b, C, f, h, w) latents. Flow matching on the base's
FlowMatchEulerDiscreteScheduler, timesteps on its 0-1000 scale as the pipeline passes them; the
velocity noise - x0.

Image-to-video (train.first_frame_conditioning_p, tasks/train/objectives.py `FirstFrame`): a drawn
share of the clips keeps its first latent frame clean, its tokens at timestep 0 and out of the loss,
as LTXImageToVideoPipeline runs the model (the image's latents in frame 0, `timestep * (1 -
conditioning_mask)`, only frames 1.. stepped). `predict` then takes the timesteps per latent frame,
(b, f), and gives each frame's timestep to its tokens: the transformer's (b, tokens) timestep.

Frame rate: the rotary embedding's time axis is scaled by (VAE's temporal factor / frame_rate). The
pipeline's `frame_rate` defaults to 25; training uses the same 25 whatever fps the clips were sampled
at (ingest.video.fps), and every generation passes it (the call convention), so training and
generation see the same positions. The clips a fine-tune makes play at the sampled fps.

Generation returns clips (`LTXPipelineOutput.frames`); `generate` gives each as a filmstrip image
(every frame side by side), which the image consumers show (validation, evaluate's grids, the
export's parity) and evaluate's scorer cuts back into frames (tasks/common/scoring.py).

LoRA on the attention's q/k/v/out of every block, self- and cross-attention (finetrainers' targets
for LTX-Video: benchmarks/ltx/README.md compares its trainable-parameter count); the T5 encoder
never trains. No ComfyUI file (its LTXV key map is unchecked
here) and no run-time GenAI adapter.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from finetune_runtime.convention import CallConvention
from tasks.common.families.denoiser import PredictInputs
from tasks.common.families.export_profile import ExportProfile
from tasks.common.families.flow import FlowDenoiser, FlowMatchingFamily
from tasks.common.families.input_images import InputImages
from tasks.common.families.latent_codec import LatentCodec
from tasks.common.families.pipeline_classes import PipelineClasses
from tasks.common.families.text_conditioner import T5Text
from tasks.common.families.tiny import seeded, t5_config, t5_tokenizer

#: the pipeline's default `frame_rate`, which training's rotary positions use too
FRAME_RATE = 25
#: frames a generation makes when its caller gives none (9: the shortest clip the 8x VAE takes beyond one frame)
DEFAULT_FRAMES = 9


class _Codec(LatentCodec):
    """LTX-Video's causal video VAE: clips in as they are, latents normalised per channel."""

    def vae_input(self, pixels: Any) -> Any:
        """Clips (b, 3, F, H, W) as they are; a batch of images as one-frame clips."""
        return pixels if pixels.ndim == 5 else pixels.unsqueeze(2)

    def scale_latents(self, vae: Any, latents: Any) -> Any:
        """LTXPipeline's `_normalize_latents`: per channel, (x - mean) * scaling_factor / std."""
        shape = (1, -1) + (1,) * (latents.ndim - 2)
        mean = vae.latents_mean.view(shape).to(latents.device, latents.dtype)
        std = vae.latents_std.view(shape).to(latents.device, latents.dtype)
        return (latents - mean) * vae.config.scaling_factor / std


class _Text(T5Text):
    """T5's last hidden state on unmasked ids, the tokenizer's mask in the pooled slot."""

    def encode_prompt(self, components: Any, input_ids: list[Any], text_encoders: list[Any] | None = None
                      ) -> tuple[Any, Any]:
        """(T5's last hidden state, the float attention mask); T5 reads the ids unmasked, as the pipeline."""
        (t5,) = text_encoders or components.text_encoders
        ids = input_ids[0].to(next(t5.parameters()).device)
        hidden = t5(ids)[0]
        return hidden, (ids != components.tokenizers[0].pad_token_id).float()


@dataclass(frozen=True)
class _Denoiser(FlowDenoiser):
    """The video transformer over packed (frame, row, column) tokens, with rotary positions scaled by the
    VAE's compression and the frame rate."""

    #: the released VAE's factors (32 in space, 8 in time); the rotary scale reads them
    spatial_compression: int = 32
    temporal_compression: int = 8

    def predict(self, denoiser: Any, noisy_latents: Any, timesteps: Any, hidden: Any, pooled: Any,
                inputs: PredictInputs) -> Any:
        from diffusers import LTXPipeline

        config = getattr(denoiser, "module", denoiser).config  # (DDP wraps it in .module)
        p, pt = config.patch_size, config.patch_size_t
        _, _, frames, height, width = noisy_latents.shape
        packed = LTXPipeline._pack_latents(noisy_latents, p, pt)
        if timesteps.ndim == 2 and timesteps.shape[1] == frames:
            # one per latent frame (first-frame conditioning), each on its frame's tokens; (b, tokens) as given
            timesteps = timesteps[:, ::pt].repeat_interleave((height // p) * (width // p), dim=1)
        rope = (self.temporal_compression / FRAME_RATE, self.spatial_compression, self.spatial_compression)
        pred = denoiser(hidden_states=packed, encoder_hidden_states=hidden, timestep=timesteps,
                        encoder_attention_mask=pooled, num_frames=frames // pt, height=height // p,
                        width=width // p, rope_interpolation_scale=rope, return_dict=False)[0]
        return LTXPipeline._unpack_latents(pred, frames // pt, height // p, width // p, p, pt)

    def latent_shape(self, pipe: Any, height: int, width: int, frames: int = DEFAULT_FRAMES) -> tuple[int, ...]:
        """One clip's starting noise as the pipeline takes it: packed tokens (sequence, channels)."""
        config = pipe.transformer.config
        grid = ((frames - 1) // pipe.vae_temporal_compression_ratio + 1) // config.patch_size_t
        side = pipe.vae_spatial_compression_ratio * config.patch_size
        return (grid * (height // side) * (width // side),
                config.in_channels * config.patch_size ** 2 * config.patch_size_t)


class LTXVideo(FlowMatchingFamily):
    name = "ltx"
    title = "LTX-Video"
    builtin = "builtin:tiny-ltx"
    pipeline = PipelineClasses(("LTXPipeline",))
    # one T5 (it never trains, as in diffusers' scripts), 128 tokens (LTXPipeline's)
    text = _Text(tokenizer_names=("tokenizer",), t5_tokenizer="tokenizer", trainable=(), max_sequence_length=128,
                 frozen_because="its T5 encoder stays frozen")
    codec = _Codec(pixel_multiple=32)
    video = True
    inputs = InputImages(most=1)  # a served request's first frame; training conditions on the clip's own
    denoiser = _Denoiser(takes_guidance_scale=False)
    # not checked against ComfyUI's LTXV key map: `lora_format: comfyui` refused
    export = ExportProfile(ov_pipeline="OVLTXPipeline", comfyui_lora_prefixes=None)

    @classmethod
    def call_convention(cls) -> CallConvention:
        """Clips of `frames` frames (DEFAULT_FRAMES where the caller gives none) at the frame rate training's
        rotary positions used, played at that rate; a served request may give the first frame (`image`),
        which LTXImageToVideoPipeline on the same model starts the clip from."""
        return replace(super().call_convention(), arguments={"frame_rate": FRAME_RATE}, latent_patch=1,
                       frames=DEFAULT_FRAMES, count_argument="num_videos_per_prompt", fps=FRAME_RATE,
                       frame_step=cls.denoiser.temporal_compression, first_frame_pipeline="LTXImageToVideoPipeline")

    @classmethod
    def generate(cls, pipe: Any, prompts: list[str] | str, *, steps: int, latents: Any = None,
                 extra: dict[str, Any] | None = None, **settings: Any) -> list[Any]:
        """One image per clip (`generate_clips` gives the frames): a filmstrip of every PIL frame, or with
        `output_type` "np" every frame side by side as one (H, F x W, C) array (what parity compares)."""
        import numpy as np

        from tasks.common.images import filmstrip

        clips = cls.generate_clips(pipe, prompts, steps=steps, latents=latents, extra=extra, **settings)
        if isinstance(clips, np.ndarray) or (clips and isinstance(clips[0], np.ndarray)):
            return [np.concatenate(list(frames), axis=1) for frames in clips]
        return [filmstrip(frames) for frames in clips]

    @classmethod
    def generate_clips(cls, pipe: Any, prompts: list[str] | str, *, steps: int, latents: Any = None,
                       extra: dict[str, Any] | None = None, **settings: Any) -> list[list[Any]]:
        """The clips of one call, each a list of PIL frames."""
        return super().generate(pipe, prompts, steps=steps, latents=latents, extra=extra, **settings)

    @classmethod
    def build_tiny(cls, seed: int) -> Any:
        """A 2-layer T5 (32 wide), a 2-block transformer 16 wide over 8 latent channels, a video VAE
        with the released one's factors (4x4 patches, three space-time halvings: 32x in space, 8x in
        time), channels 8 wide; the released scheduler's dynamic shift."""
        from diffusers import (
            AutoencoderKLLTXVideo,
            FlowMatchEulerDiscreteScheduler,
            LTXPipeline,
            LTXVideoTransformer3DModel,
        )
        from transformers import T5EncoderModel

        tokenizer = t5_tokenizer(max_length=cls.text.max_sequence_length)
        text_encoder = seeded(seed + 2, lambda: T5EncoderModel(t5_config(len(tokenizer), d_model=32)))
        transformer = seeded(seed, lambda: LTXVideoTransformer3DModel(
            in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=2, attention_head_dim=8,
            cross_attention_dim=16, num_layers=2, caption_channels=32))
        levels = (True, True, True, False)
        vae = seeded(seed + 1, lambda: AutoencoderKLLTXVideo(
            in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(8, 8, 8, 8),
            decoder_block_out_channels=(8, 8, 8, 8), layers_per_block=(1, 1, 1, 1, 1),
            decoder_layers_per_block=(1, 1, 1, 1, 1), spatio_temporal_scaling=levels,
            decoder_spatio_temporal_scaling=levels, decoder_inject_noise=(False,) * 5, upsample_residual=(False,) * 4,
            upsample_factor=(1,) * 4, timestep_conditioning=False, patch_size=4, patch_size_t=1, encoder_causal=True,
            decoder_causal=False))
        # Lightricks/LTX-Video's scheduler config: dynamic shift over the video's token count
        scheduler = FlowMatchEulerDiscreteScheduler(
            shift=1.0, use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05, base_image_seq_len=1024,
            max_image_seq_len=4096, shift_terminal=0.1)
        return LTXPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                           transformer=transformer)
