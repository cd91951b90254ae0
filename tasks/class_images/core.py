"""Generate class images for the prior-preservation loss, resumably, one fixed seed per image.

Image `i` is always `{i:05d}.png`, drawn from a generator seeded with `seed + i`: the same picture
whether it is made alone, in a batch of any size, or by any rank of a split run (`shard`). What is
already on disk is reused when it was made with the same generation settings and base model
(recorded in `generation.json`); a change of prompt, resolution, sampler settings, seed or base
weights makes the old images stale and they are replaced. Pure work on folders: no MLflow here.
"""
from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image
from tqdm import tqdm

from finetune_runtime.cpu_formats import Choice, emulated_bf16_problem
from tasks.class_images import encoded
from tasks.class_images.config import ClassImagesConfig
from tasks.common import families
from tasks.common.errors import UserError
from tasks.common.fingerprint import folder_fingerprint
from tasks.common.outputs import atomic_file
from tasks.common.quantize import BasePrecision
from tasks.common.quantized_pipeline import compute_choice, load_with_denoiser_last
from tasks.common.safe_remove import refusal

log = logging.getLogger(__name__)

METADATA = "metadata.jsonl"  # Hugging Face imagefolder metadata: file_name, text
STATE = "generation.json"  # the settings and base model the images on disk were made with
_IMAGE = re.compile(r"^(\d{5})\.png$")
_LEFTOVER = re.compile(r"^\..+\.tmp-")  # atomic_file's temporaries left by a killed run


def image_name(index: int) -> str:
    return f"{index:05d}.png"


def generation_key(cfg: ClassImagesConfig, base_fingerprint: str, precision: str | None = None) -> dict[str, Any]:
    """Everything that changes the pixels of image i (not num_images, not batch_size). The precision
    they are made in (`precision`: what `pipeline_choice` chose; None: class_images.precision, auto as
    fp32) when it is not fp32 (fp32 keeps the keys folders already hold), a quantized denoiser's
    precision and library (none keeps them too), and tiled VAE decoding."""
    key = {
        "prompt": cfg.prompt,
        "negative_prompt": cfg.negative_prompt,
        "resolution": cfg.resolution,
        "num_inference_steps": cfg.num_inference_steps,
        "guidance_scale": cfg.guidance_scale,
        "seed": cfg.seed,
        "base_fingerprint": base_fingerprint,
    }
    if held := quantized(cfg):
        key["base_model_precision"] = held.name
    if vae_decode(cfg) == "tiled":  # tiles change pixels; sliced decoding does not
        key["vae_decode"] = "tiled"
    precision = precision or ("fp32" if cfg.precision == "auto" else cfg.precision)
    return key if precision == "fp32" else {**key, "precision": precision}


#: class_images.vae_decode auto decodes in tiles above this side (px): a 2048 px FLUX VAE decode
#: holds a 128-channel activation of the whole image (2 GiB in fp32) at each of its last blocks
TILE_ABOVE = 1024


def vae_decode(cfg: ClassImagesConfig) -> str:
    """full | sliced | tiled: class_images.vae_decode, auto resolved by the resolution."""
    if cfg.vae_decode != "auto":
        return cfg.vae_decode
    return "tiled" if cfg.resolution > TILE_ABOVE else "sliced"


def set_vae_decode(pipe: Any, cfg: ClassImagesConfig) -> None:
    """Turn the pipeline's VAE to sliced or tiled decoding (diffusers' AutoencoderMixin); a VAE without
    it decodes whole under auto, and is refused when the mode was asked for by name."""
    mode, vae = vae_decode(cfg), getattr(pipe, "vae", None)
    if vae is None:
        return
    try:  # every flag set, so a pipeline passed in again decodes as this run asks
        (vae.enable_slicing if mode in ("sliced", "tiled") else vae.disable_slicing)()
        (vae.enable_tiling if mode == "tiled" else vae.disable_tiling)()
    except (AttributeError, NotImplementedError):
        if mode not in ("sliced", "tiled"):
            return
        if cfg.vae_decode != "auto":
            raise UserError(f"class_images.vae_decode: {mode}: this base's VAE ({type(vae).__name__}) has no {mode} "
                            "decoding; set vae_decode: full or auto") from None
        log.info("class images: %s has no %s decoding; it decodes whole", type(vae).__name__, mode)


def quantized(cfg: ClassImagesConfig) -> BasePrecision | None:
    """The quantized denoiser `cfg` asks for (its base_model_precision, resolved: following_train)."""
    return BasePrecision.parse(cfg.base_model_precision or "none", key="class_images.base_model_precision")


@dataclass
class Plan:
    """What to do in the output folder: indices to generate, indices to keep, files to delete."""

    missing: list[int]
    reused: list[int]
    remove: list[Path] = field(default_factory=list)


def _is_valid_png(path: Path, resolution: int) -> bool:
    try:
        with Image.open(path) as im:
            if im.size != (resolution, resolution):
                return False
            im.verify()  # checks the chunks' CRCs: a truncated file fails here
        return True
    except Exception:
        return False


def plan(out_dir: Path, cfg: ClassImagesConfig, key: dict[str, Any]) -> Plan:
    """Compare the folder with what the config asks for.

    Images beyond `num_images` are removed (the folder then holds exactly what params say, and
    training uses exactly that many); unreadable images and those made with other settings are
    regenerated; leftovers of a killed run are deleted. Only in a folder this stage made (its
    STATE file, written before any image, is its marker): images named like ours in a folder
    without it are someone else's, and nothing there is removed.
    """
    out_dir = Path(out_dir)
    state_path = out_dir / STATE
    if out_dir.is_dir() and not state_path.is_file():
        theirs = sorted(p.name for p in out_dir.iterdir() if _IMAGE.match(p.name))
        if theirs:
            raise UserError(f"{out_dir} holds images named as this stage names its own ({theirs[0]}, ...) but no "
                            f"{STATE}: this stage did not make them, so it replaces none; move them away or "
                            "pass --out a folder of its own")
        return Plan(missing=list(range(cfg.num_images)), reused=[], remove=[])
    same_settings = False
    if state_path.is_file():
        try:
            same_settings = json.loads(state_path.read_text()) == key
        except json.JSONDecodeError:
            same_settings = False
    existing: dict[int, Path] = {}
    remove: list[Path] = []
    for path in sorted(out_dir.iterdir()) if out_dir.is_dir() else []:
        match = _IMAGE.match(path.name)
        if match:
            existing[int(match.group(1))] = path
        elif _LEFTOVER.match(path.name):
            remove.append(path)
    if existing and not same_settings:
        log.info("%d images in %s were made with other settings or another base model: regenerating",
                 len(existing), out_dir)
    reused: list[int] = []
    for index, path in existing.items():
        if index < cfg.num_images and same_settings and _is_valid_png(path, cfg.resolution):
            reused.append(index)
        else:
            remove.append(path)
    keep = set(reused)
    missing = [i for i in range(cfg.num_images) if i not in keep]
    return Plan(missing=missing, reused=reused, remove=remove)


def shard(indices: Sequence[int], rank: int, world_size: int) -> list[int]:
    """The indices rank `rank` of `world_size` generates (round-robin, so shards stay balanced)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size}")
    return list(indices[rank::world_size])


def pipeline_dtype(base: Path, device: Any, precision: str = "auto") -> Any:
    """The torch dtype `precision` (class_images.precision) means for this base on `device`."""
    return pipeline_choice(base, device, precision)[0]


def pipeline_choice(base: Path, device: Any, precision: str = "auto") -> tuple[Any, Choice]:
    """(the torch dtype `precision` means for this base on `device`, the choice and why): auto is fp16
    on CUDA; on a CPU bf16 where the base's denoiser is stored in 16 bits and the CPU computes bf16
    natively, else fp32 (finetune_runtime/cpu_formats.py). An explicit bf16 on a CPU that would emulate
    it is refused (UserError: the cost and the fix), before anything loads."""
    import torch

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    kind = torch.device(device).type
    if precision != "auto":
        if precision == "bf16" and kind == "cpu" and (problem := emulated_bf16_problem(
                "class_images.precision", "class_images.precision: auto or fp32")):
            raise UserError(f"params.yaml: {problem}")
        return dtypes[precision], Choice(precision, f"class_images.precision: {precision}")
    if kind == "cuda":
        return torch.float16, Choice("fp16", "auto: fp16 on CUDA")
    dtype, why = compute_choice(base, kind)
    return dtype, Choice({v: k for k, v in dtypes.items()}[dtype], f"auto: {why}")


def load_pipeline(base: Path, device: Any = None, precision: str = "auto", quantize: BasePrecision | None = None,
                  encode: Sequence[Callable[[Any], Any]] = ()) -> Any:
    """The base model as a diffusers pipeline (any family), safety checker off, on the best device,
    in `precision` (class_images.precision: `pipeline_dtype`); with `quantize`, the denoiser's Linear
    layers quantized as they load, a chunk at a time (the train stage's path: its full-precision
    weights are never all in memory), the rest of the pipeline in `precision`. With `encode` (the
    pipeline calls to come, `text_calls`), their text is encoded first and the text encoders
    released before the denoiser loads (tasks/class_images/encoded.py).

    The safety checker is turned off as in diffusers' DreamBooth example: it would replace some
    class images by black squares, which the prior loss would then learn.
    """
    import diffusers
    from diffusers import DiffusionPipeline
    from diffusers.configuration_utils import FrozenDict

    index = families.read_index(base, "run the `base` stage first (dvc repro base)")
    extra: dict[str, Any] = {}
    if "safety_checker" in index:
        extra = {"safety_checker": None, "requires_safety_checker": False}
    device = _device(device)
    dtype = pipeline_dtype(base, device, precision)
    held = f", the denoiser in {quantize.name}" if quantize else ""
    log.info("class images: the base pipeline in %s%s on %s", str(dtype).removeprefix("torch."), held, device)
    if quantize is not None and (problem := quantize.problem(device.type, key="base_model_precision",
                                                              section="class_images")):
        raise UserError(problem)
    if not encode and quantize is None:
        pipe = DiffusionPipeline.from_pretrained(base, dtype=dtype, **extra).to(device)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def encode_first(pipe: Any, index: dict[str, Any]) -> None:
        if encode:
            name = families.from_index(index, str(base)).denoiser.name
            config = FrozenDict(getattr(diffusers, index[name][1]).load_config(base, subfolder=name))
            encoded.release_text_encoders(pipe, encoded.record(pipe, encode, config))

    return load_with_denoiser_last(base, dtype, device, quantize, extra, encode_first)


def _batches(indices: Sequence[int], size: int) -> Iterable[list[int]]:
    for start in range(0, len(indices), size):
        yield list(indices[start : start + size])


def _call(pipe: Any, cfg: ClassImagesConfig, generators: list[Any]) -> list[Image.Image]:
    """One pipeline call: the class prompt once per generator."""
    n = len(generators)
    return families.of_pipeline(pipe).generate(
        pipe, [cfg.prompt] * n, height=cfg.resolution, width=cfg.resolution, steps=cfg.num_inference_steps,
        guidance=cfg.guidance_scale, generator=generators,
        negative=[cfg.negative_prompt] * n if cfg.negative_prompt else None)


def text_calls(cfg: ClassImagesConfig, indices: Sequence[int]) -> list[Callable[[Any], Any]]:
    """The calls whose text `generate` will need (one per batch size it uses), for load_pipeline's `encode`."""
    import torch

    sizes = sorted({len(batch) for batch in _batches(indices, cfg.batch_size)})
    return [lambda pipe, n=n: _call(pipe, cfg, [torch.Generator("cpu").manual_seed(0) for _ in range(n)])
            for n in sizes]


def generate(pipe: Any, cfg: ClassImagesConfig, indices: Sequence[int], out_dir: Path) -> list[Path]:
    """Generate and write images `indices` (each PNG written atomically); returns their paths."""
    import torch

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    with tqdm(total=len(indices), desc="class images", unit="img", disable=None) as bar:
        for batch in _batches(indices, cfg.batch_size):
            # CPU generators: the initial noise is the same on every device (diffusers moves it).
            images = _call(pipe, cfg, [torch.Generator("cpu").manual_seed(cfg.seed + i) for i in batch])
            for index, image in zip(batch, images):
                path = out_dir / image_name(index)
                with atomic_file(path) as tmp:
                    image.save(tmp, format="PNG")
                written.append(path)
            bar.update(len(batch))
    return written


def write_metadata(out_dir: Path, cfg: ClassImagesConfig) -> Path:
    """metadata.jsonl listing exactly images 0..num_images-1 with the class prompt."""
    path = Path(out_dir) / METADATA
    with atomic_file(path) as tmp, open(tmp, "w", encoding="utf-8") as fh:
        for i in range(cfg.num_images):
            fh.write(json.dumps({"file_name": image_name(i), "text": cfg.prompt}, ensure_ascii=False) + "\n")
    return path


@dataclass
class Summary:
    num_images: int
    generated: int
    reused: int
    removed: int
    seconds: float
    base_fingerprint: str
    per_concept: dict[str, Summary] = field(default_factory=dict)  # class_images.concepts: each one's

    def report(self) -> dict[str, Any]:
        """reports/class_images.json (DVC metrics: numbers only)."""
        concepts = {name: s.report() for name, s in self.per_concept.items()}
        return {
            **({"concepts": concepts} if concepts else {}),
            "num_images": self.num_images,
            "generated": self.generated,
            "reused": self.reused,
            "removed": self.removed,
            "seconds": round(self.seconds, 3),
            "seconds_per_generated_image": round(self.seconds / self.generated, 4) if self.generated else 0.0,
        }


def _device(device: Any = None) -> Any:
    """`device`, else the best there is (cuda, else cpu)."""
    import torch

    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def _nothing() -> None:
    return None


def run(cfg: ClassImagesConfig, base: Path, out_dir: Path, pipe: Any = None, rank: int = 0, world_size: int = 1,
        barrier: Callable[[], None] = _nothing, device: Any = None) -> Summary:
    """Bring `out_dir` to exactly `num_images` valid images for `cfg`, on one rank or split over many.

    Split: rank 0 removes what is stale and records the settings; then every rank plans from the same
    folder, generates its `shard` of the missing images (files named as in a one-rank run, so the
    result is the same), and rank 0 writes the metadata once all are done. `barrier` waits for every
    rank (accelerate's wait_for_everyone). `pipe` may be passed in (tests, or a caller that already
    loaded the base model); it is loaded only when this rank has something to generate.
    """
    start = time.perf_counter()
    base, out_dir = Path(base), Path(out_dir)
    if not base.is_dir():
        raise UserError(f"base model folder {base} not found: run the `base` stage first (dvc repro base)")
    family = families.detect(base)
    if why := families.class_images_refusal(family):
        raise UserError(f"class images: {why} for prior preservation; set train.with_prior_preservation: false")
    fingerprint = folder_fingerprint(base)
    _, precision = pipeline_choice(base, _device(device), cfg.precision)  # an emulated bf16: refused here
    log.info("class images: %s", precision.line("class_images.precision"))
    key = generation_key(cfg, fingerprint, precision.precision)
    removed = 0
    if rank == 0:
        if why := refusal(out_dir):
            raise UserError(f"class images: refusing --out {out_dir}: it {why}; pass a folder of its own")
        out_dir.mkdir(parents=True, exist_ok=True)
        todo = plan(out_dir, cfg, key)
        for path in todo.remove:
            path.unlink(missing_ok=True)
        removed = len(todo.remove)
        if todo.remove:
            log.info("removed %d stale or surplus files from %s", removed, out_dir)
        # Recorded before generating: images a killed run leaves are then known to match the key.
        with atomic_file(out_dir / STATE) as tmp:
            tmp.write_text(json.dumps(key, indent=2, sort_keys=True) + "\n")
    barrier()
    todo = plan(out_dir, cfg, key)  # the same on every rank: nothing is written until all have planned
    barrier()
    mine = shard(todo.missing, rank, world_size)
    log.info("class images: %d to generate (%d by rank %d of %d), %d reused in %s", len(todo.missing), len(mine),
             rank, world_size, len(todo.reused), out_dir)
    if mine:
        if pipe is None:  # the text encoded and its encoders released before the denoiser loads
            pipe = load_pipeline(base, device, cfg.precision, quantized(cfg), encode=text_calls(cfg, mine))
        set_vae_decode(pipe, cfg)  # also on a pipeline passed in
        generate(pipe, cfg, mine, out_dir)
    barrier()
    if rank == 0:
        write_metadata(out_dir, cfg)
    return Summary(
        num_images=cfg.num_images,
        generated=len(todo.missing),
        reused=len(todo.reused),
        removed=removed,
        seconds=time.perf_counter() - start,
        base_fingerprint=fingerprint,
    )
