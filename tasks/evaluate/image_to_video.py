"""Image-to-video clips: a video fine-tune trained to start clips from a given first frame, scored doing that.

A video family whose call convention names a `first_frame_pipeline` (LTX-Video: LTXImageToVideoPipeline)
trains its clips as image-to-video when `train.first_frame_conditioning_p` > 0 (the first latent frame
kept clean, as that pipeline runs the model). Such a fine-tune is then also evaluated that way: each of
the first `evaluate.image_to_video.max_clips` subject clips of the instance data (ingest's clips.jsonl,
in its order) is continued from its first frame, with its caption as the prompt, by the fine-tune and by
the base alike. The first-frame pipeline is the runtime's (finetune_runtime/load.py
`first_frame_pipeline`: diffusers' class built on the same modules, as the served model makes it for a
request with `image`), called through the family's `generate` (finetune_runtime/pipeline_call.py).

Clip j of every subject clip is made with a CPU generator seeded `seed + j`, one clip per call, for both
models: the pipeline draws the first frame's latent sample and then the other frames' noise from it, so
both models start from the same latents. No `latents` are passed: LTXImageToVideoPipeline takes given
latents as they are and never encodes the image (the clip would not start from it).

Scored as the text-to-video clips are (tasks/common/scoring.py): per frame, CLIP-T against the caption
without the identifier, CLIP-I and DINO against the subject frames, and temporal consistency; reported as
`i2v_<metric>`, `base_i2v_<metric>` and `gain_i2v_<metric>`.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image
from tqdm import tqdm

from finetune_runtime.load import DIFFUSERS, Loaded, first_frame_pipeline
from tasks.common import families
from tasks.common.errors import UserError
from tasks.common.images import to_rgb
from tasks.common.openvino_model import StaticShape
from tasks.common.scoring import Encoders, Scorer, clip_t_text
from tasks.evaluate.edits import images_hash

log = logging.getLogger(__name__)

#: the prefix of the image-to-video metrics (`i2v_dino`, `base_i2v_dino`, `gain_i2v_dino`)
PREFIX = "i2v_"
CLIPS = "clips.jsonl"


@dataclass(frozen=True)
class Start:
    """One subject clip to continue: its folder (clips.jsonl `file_name`), caption and first frame."""

    clip: str
    caption: str
    image: Image.Image


def load_starts(instance_data: Path, max_clips: int, fallback_prompt: str) -> list[Start]:
    """The first `max_clips` subject clips of `instance_data`, each with its first frame and caption
    (`fallback_prompt` for a clip without one); a UserError where the data holds no clips."""
    listing = Path(instance_data) / CLIPS
    if not listing.is_file():
        raise UserError(f"evaluate.image_to_video starts clips from the subject clips' first frames, but "
                        f"{instance_data} has no {CLIPS} (ingest's clips); set evaluate.image_to_video.enabled: "
                        "false, or evaluate on the clips the model trained on")
    rows = [json.loads(line) for line in listing.read_text().splitlines() if line.strip()][:max_clips]
    if not rows:
        raise UserError(f"{listing} lists no clips: nothing to start image-to-video clips from")
    starts = []
    for row in rows:
        with Image.open(Path(instance_data) / row["file_name"] / row["frame_files"][0]) as first:
            starts.append(Start(row["file_name"], str(row.get("text") or fallback_prompt), to_rgb(first).copy()))
    log.info("image-to-video: %d subject clips continued from their first frames", len(starts))
    return starts


def starts_hash(starts: list[Start]) -> dict[str, Any]:
    """The starts as plain JSON (their captions and first frames' content hash): the protocol's and
    the base image cache's."""
    text = json.dumps([[s.clip, s.caption] for s in starts])
    digest = hashlib.sha256((text + images_hash([s.image for s in starts])).encode()).hexdigest()[:16]
    return {"set": digest, "clips": len(starts)}


def refusal(family: type[families.ModelFamily]) -> str | None:
    """Why `family` cannot make image-to-video clips (None: it can)."""
    if family.call_convention().first_frame_pipeline is None:
        return f"{family.title} has no pipeline that starts a clip from an image"
    return None


def generate(pipe: Any, starts: list[Start], shape: StaticShape, images_per_prompt: int, seed: int,
             num_inference_steps: int, guidance_scale: float, desc: str) -> tuple[list[list[Any]], float]:
    """clips[c][j]: subject clip c continued from its first frame from seed + j (a filmstrip each, as the
    family's `generate` gives clips), and the seconds it took; `pipe` is the model's text-to-video pipeline,
    whose modules the first-frame pipeline shares."""
    import torch

    family = families.of_pipeline(pipe)
    name = family.call_convention().first_frame_pipeline
    if name is None:
        raise UserError(f"evaluate.image_to_video: {refusal(family)}")
    i2v = first_frame_pipeline(Loaded(pipe, DIFFUSERS.name, ""), name)
    i2v.set_progress_bar_config(disable=True)
    clips: list[list[Any]] = [[] for _ in starts]
    start = time.perf_counter()
    for c, j in tqdm([(c, j) for c in range(len(starts)) for j in range(images_per_prompt)], desc=desc,
                     unit="call", disable=None):
        clips[c] += family.generate(
            i2v, [starts[c].caption], steps=num_inference_steps, height=shape.height, width=shape.width,
            guidance=guidance_scale, generator=torch.Generator("cpu").manual_seed(seed + j), output_type="pil",
            image=[starts[c].image])
    seconds = time.perf_counter() - start
    log.info("%s: %d clips in %.1f s", desc, sum(map(len, clips)), seconds)
    return clips, seconds


def scores(encoders: Encoders, real: list[Image.Image], frames: int, starts: list[Start], tuned: list[list[Any]],
           based: list[list[Any]] | None, identifier: str) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """The `i2v_` metrics of the fine-tune's clips (`base_i2v_`, `gain_i2v_` beside the base's), and one
    row per subject clip."""
    texts = [clip_t_text(s.caption, identifier) for s in starts]
    scorer = Scorer(encoders.clip, encoders.dino, encoders.clip.embed_texts(texts), real, frames)
    overall, per_clip = scorer.scores(tuned)
    metrics = {f"{PREFIX}{k}": v for k, v in overall.items()}
    base_per_clip = None
    if based is not None:
        base_overall, base_per_clip = scorer.scores(based)
        for name, value in base_overall.items():
            metrics[f"base_{PREFIX}{name}"] = value
            metrics[f"gain_{PREFIX}{name}"] = overall[name] - value
    rows = []
    for c, start in enumerate(starts):
        row: dict[str, Any] = {"clip": start.clip, "prompt": start.caption, "clip_t_text": texts[c]}
        for name in per_clip[c]:  # CLIP-T, CLIP-I, DINO, temporal consistency
            row[name] = round(per_clip[c][name], 6)
            if base_per_clip is not None:
                row[f"{name}_base"] = round(base_per_clip[c][name], 6)
        rows.append(row)
    return metrics, rows
