"""Training data: imagefolders (metadata.jsonl) into examples, deterministic wherever they are made.

An example holds one instance image with its prompt and, with prior preservation, one class
image; a batch puts all instance images first and all class images after, so the loss can split
the prediction in two halves (as diffusers' DreamBooth example does). The length is
max(instances, class images): every class image is seen once per epoch while few instances repeat.

Every random choice about an example (random crop, flip, tag shuffle, caption dropout, prompt
template, and the seed of its diffusion noise) is drawn from a generator seeded by (seed, epoch,
index), never from a global RNG. So an example is the same whether it is loaded in the main process
or a worker, on rank 0 or rank 3, in a straight run or after a resume that skipped the batches
before it: resume is exact, and 2 ranks x batch b train as 1 rank x batch 2b.
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset, Sampler

from tasks.common.errors import UserError
from tasks.common.families import Geometry
from tasks.common.images import apply_exif_orientation, cover_size, follow_geometry, to_rgb
from tasks.train.batch import Batch
from tasks.train.clips import clip_digest, clip_pixels
from tasks.train.layout import Layout
from tasks.train.references import load_references, stack_references

log = logging.getLogger(__name__)

METADATA = "metadata.jsonl"


@dataclass(frozen=True)
class Record:
    """One image of an imagefolder: its caption and, when the ingest stored them, its tags."""

    path: Path
    text: str
    tags: tuple[str, ...] = ()
    tag_separator: str = ", "
    score: float | None = None
    size: tuple[int, int] | None = None  # (height, width) when the metadata has them (the ingest writes them)
    concept: str | None = None  # the row's concept (ingest: a source's, or a kohya folder's)
    repeats: int = 1  # times an epoch shows it (ingest's; train.concepts may override)
    mask: Path | None = None  # the subject mask (`mask_file_name`, from the ingest stage)
    references: tuple[Path, ...] = ()  # reference images of an edit triple (`reference_file_names`, ingest)
    frames: tuple[Path, ...] = ()  # a clip's frames (a video model's data: `path` is the clip's folder, clips.py)

    def image_size(self) -> tuple[int, int]:
        """(height, width) of the upright image: the metadata's, else read from the file's header."""
        if self.size is not None:
            return self.size
        with Image.open(self.path) as im:
            swap = im.getexif().get(0x0112, 1) in (5, 6, 7, 8)  # EXIF orientations that turn by 90 degrees
            return (im.width, im.height) if swap else (im.height, im.width)


def read_imagefolder(folder: Path, what: str, fix: str, caption_column: str = "text") -> list[Record]:
    """The rows of `folder/metadata.jsonl` whose image exists; a UserError (with `fix`) if none.

    `what` names the folder in messages ("instance images", "class images"). `tags` (a list),
    `tag_separator` and `score` are optional columns (the ingest stage writes them).
    """
    folder = Path(folder)
    meta = folder / METADATA
    if not meta.is_file():
        raise UserError(f"{what}: {meta} not found. {fix}")
    records: list[Record] = []
    with open(meta, encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                path = folder / row["file_name"]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise UserError(
                    f"{what}: {meta}:{line_no} is not a JSON object with a file_name ({err}). {fix}") from None
            records.append(_record(folder, row, path, f"{what}: {meta}:{line_no}", fix, caption_column))
    if not records:
        raise UserError(f"{what}: {folder} holds no images. {fix}")
    return records


def _record(folder: Path, row: dict[str, Any], path: Path, where: str, fix: str, caption_column: str) -> Record:
    """One metadata row as a Record, its image, mask and references checked on disk; `where` (what,
    file and line) and `fix` in the UserError of a missing one."""
    if not path.is_file():
        raise UserError(f"{where} lists {row['file_name']}, which is missing. {fix}")
    mask = folder / row["mask_file_name"] if row.get("mask_file_name") else None
    if mask is not None and not mask.is_file():
        raise UserError(f"{where} lists the mask {row['mask_file_name']}, which is missing. {fix}")
    refs = tuple(folder / name for name in row.get("reference_file_names") or ())
    if missing := [str(r.relative_to(folder)) for r in refs if not r.is_file()]:
        raise UserError(f"{where} lists the reference image(s) {', '.join(missing)}, which are missing. {fix}")
    if caption_column != "text" and caption_column not in row:
        raise UserError(f"{where} has no column {caption_column!r} (train.caption_column); columns: "
                        f"{', '.join(sorted(row))}")
    tags = row.get("tags") or ()
    return Record(path, str(row.get(caption_column) or ""), tuple(str(t) for t in tags),
                  row.get("tag_separator") or ", ", row.get("score"), _size(row), row.get("concept"),
                  _repeats(row), mask, refs)


def _repeats(row: dict[str, Any]) -> int:
    value = row.get("repeats")
    return value if isinstance(value, int) and value >= 1 else 1


def _size(row: dict[str, Any]) -> tuple[int, int] | None:
    height, width = row.get("height"), row.get("width")
    return (int(height), int(width)) if isinstance(height, int) and isinstance(width, int) else None


@dataclass(frozen=True)
class CaptionPolicy:
    """Training-time caption rules: tag shuffling keeping the first N tags, and caption dropout."""

    shuffle_tag_p: float = 0.0
    keep_tokens: int = 0
    proportion_empty_prompts: float = 0.0

    def __call__(self, record: Record, rng: np.random.Generator) -> str:
        # Both draws always happen, so the stream of choices does not depend on the data.
        shuffle, drop = rng.random() < self.shuffle_tag_p, rng.random() < self.proportion_empty_prompts
        text = record.text
        if shuffle and len(record.tags) > self.keep_tokens + 1:
            keep, rest = list(record.tags[: self.keep_tokens]), list(record.tags[self.keep_tokens:])
            text = record.tag_separator.join(keep + [rest[i] for i in rng.permutation(len(rest))])
        return "" if drop else text

    @property
    def varies(self) -> bool:
        """True when one image's prompt changes between epochs (no prompt caching then)."""
        return self.shuffle_tag_p > 0


def prepare_image(
    image: Image.Image, resolution: int | tuple[int, int], center_crop: bool, flip: bool,
    rng: np.random.Generator | None = None,
) -> tuple[torch.Tensor, tuple[int, int], tuple[int, int]]:
    """Resize to cover the target, crop it, optionally flip; -> (CHW in [-1, 1], original (h, w), crop (top, left)).

    The target is a square side or a bucket's (height, width); the original size and crop corner
    are what SDXL's micro-conditioning takes.
    """
    th, tw = (resolution, resolution) if isinstance(resolution, int) else resolution
    image = to_rgb(apply_exif_orientation(image))
    original = (image.height, image.width)
    width, height = cover_size(original, (th, tw))
    if center_crop or rng is None:
        top, left = (height - th) // 2, (width - tw) // 2
    else:
        top = int(rng.integers(0, height - th + 1))
        left = int(rng.integers(0, width - tw + 1))
    image = follow_geometry(image, original, (th, tw), (top, left), flip)
    array = np.asarray(image, dtype=np.float32) / 127.5 - 1.0
    return torch.from_numpy(array).permute(2, 0, 1).contiguous(), original, (top, left)


def prepare_mask(mask: Image.Image, original: tuple[int, int], target: tuple[int, int], crop: tuple[int, int],
                 flip: bool) -> torch.Tensor:
    """A subject mask through its image's `prepare_image` geometry -> [1, H, W] weights in [0, 1].

    `original`, `crop`: what prepare_image returned for the image (a mask of another size is
    first stretched onto the image's)."""
    mask = follow_geometry(apply_exif_orientation(mask).convert("L"), original, target, crop, flip)
    return torch.from_numpy(np.asarray(mask, dtype=np.float32) / 255.0)[None]


PromptFn = Callable[[Record, np.random.Generator], str]


def latent_key(digest: str, target: tuple[int, int], flip: bool, mask_digest: str | None = None) -> str:
    """The latent cache's key: it names the pixels (the file's SHA-256, the size it is cropped to, the flip)
    and, in masked training, the mask file's SHA-256 (the entry then holds the latent-size mask)."""
    key = f"{digest}:{target[0]}x{target[1]}:{int(flip)}"
    return f"{key}:mask={mask_digest}" if mask_digest else key


@dataclass
class TrainDataset(Dataset):
    """Instance images with per-method prompts, paired with class images and the class prompt.

    Indexed by (epoch, index) pairs from `EpochSampler` (or batches of them from the buckets'
    sampler). Each example has a `latent_key` when its pixels are fixed (centre crop): the same
    key means the same pixels (same file content, same target size, same flip); with a disk
    latent store (`read_latents_from`) an example whose key is stored is read, not decoded. With
    `buckets`, an example's target is its instance image's bucket, and its class image is
    cropped to that bucket too (a batch must share one size).
    """

    instances: list[Record]
    classes: list[Record] | None
    prompt: PromptFn
    class_prompt: str
    resolution: int
    center_crop: bool = True
    random_flip: bool = False
    seed: int = 0
    buckets: list[tuple[int, int]] | None = None  # (height, width); None: square `resolution`
    layout: Layout | None = None  # the concepts (tasks/train/concepts.py); None: one, rows repeated as ingest said
    classes_: list[Record] = field(init=False)
    bucket_of: list[int] = field(init=False)  # per instance image
    latent_store: Any = field(default=None, init=False)  # a DiskLatentStore read instead of decoding
    masked: bool = False  # masked_loss: instance images' masks weight the loss
    unmasked_probability: float = 0.0  # chance that an example trains unmasked

    def __post_init__(self) -> None:
        from tasks.train.buckets import assign

        self.classes_ = self.classes or []
        if self.layout is None:
            self.layout = Layout.single([r.repeats for r in self.instances], len(self.classes_))
        self.bucket_of = assign([r.image_size() for r in self.instances], self.buckets) if self.buckets else []

    def target(self, index: int) -> tuple[int, int]:
        """(height, width) the example at `index` trains at (a clip: its own, ingest's bucket)."""
        record = self.instances[self.layout.instance(index)]
        if record.frames:
            return record.size
        if not self.buckets:
            return (self.resolution, self.resolution)
        return self.buckets[self.bucket_of[self.layout.instance(index)]]

    def batch_groups(self) -> list[tuple[int, int]] | None:
        """What each example's batch must share, per example index (for the batch sampler): its bucket (one
        size) and its number of reference images (an edit's; one token sequence length); a clip its size
        and frame count. None when every example shares them (no buckets, one reference count, clips of
        one bucket): batches are then drawn from all of them."""
        counts = [len(r.references) for r in self.instances]
        clips = [(r.size, len(r.frames)) if r.frames else None for r in self.instances]
        if not self.buckets and len(set(counts)) <= 1 and len(set(clips)) <= 1:
            return None
        return [(clips[j] or (self.bucket_of[j] if self.buckets else 0), counts[j])
                for j in map(self.layout.instance, range(len(self)))]

    def bucket_counts(self) -> dict[str, int]:
        """Instance images per bucket ('HxW' -> count); empty without buckets."""
        from tasks.train.buckets import counts

        return counts(self.buckets, self.bucket_of) if self.buckets else {}

    def __len__(self) -> int:
        return len(self.layout)

    def read_latents_from(self, store: Any) -> None:
        """With a disk latent store (tasks/train/latent_store.py), an example whose latent is there
        carries it (`latent`, with the stored crop geometry) and its image is not decoded."""
        self.latent_store = store if self.center_crop else None

    def latent_inputs(self) -> list[tuple[Record, tuple[int, int], bool]]:
        """Every (image, target size, flip) an epoch can hand to the latent cache: what it holds after
        a full pass, so it can be filled before the first step (the methods' fill_latent_cache)."""
        flips = (False, True) if self.random_flip else (False,)
        seen: set[tuple[Path, tuple[int, int], bool]] = set()
        out = []
        for index in range(len(self)):
            target = self.target(index)
            _, i, c = self.layout.locate(index)
            records = [self.instances[i]] + ([self.classes_[c]] if c is not None else [])
            for record in records:
                for flip in flips:
                    if (record.path, target, flip) not in seen:
                        seen.add((record.path, target, flip))
                        out.append((record, target, flip))
        return out

    def masks(self, record: Record) -> bool:
        """True when `record`'s mask weights its loss (masked_loss on, an instance image with a mask)."""
        return self.masked and record.mask is not None

    def mask_digest(self, record: Record, digest: Any = None) -> str | None:
        """The mask file's SHA-256 for the latent key (None without a mask in use)."""
        if not self.masks(record):
            return None
        return digest(record.mask) if digest else hashlib.sha256(record.mask.read_bytes()).hexdigest()

    def load_mask(self, record: Record, original: tuple[int, int], target: tuple[int, int], crop: tuple[int, int],
                  flip: bool) -> torch.Tensor:
        """`record`'s mask with the geometry its image got ([1, H, W] in [0, 1])."""
        with Image.open(record.mask) as mask:
            return prepare_mask(mask, original, target, crop, flip)

    def _cached(self, record: Record, target: tuple[int, int], flip: bool) -> dict[str, Any] | None:
        digest = self.latent_store.hashes.digest
        content = clip_digest(record.frames, digest) if record.frames else digest(record.path)
        key = latent_key(content, target, flip, self.mask_digest(record, digest))
        entry = self.latent_store.get(key)
        if entry is None or (self.masks(record) and "mask" not in entry):
            return None
        return {"pixels": None, "latent": entry["parameters"], "latent_key": key, "target_size": target,
                "original_size": tuple(entry["original_size"].tolist()),
                "crop_top_left": tuple(entry["crop_top_left"].tolist()), "mask": entry.get("mask")}

    def _load(self, kind: str, position: int, record: Record, rng: np.random.Generator,
              target: tuple[int, int]) -> dict[str, Any]:
        flip = bool(rng.random() < 0.5) if self.random_flip else False
        out = self._pixels_or_latent(record, rng, target, flip)
        if record.references:  # edit training: the references get the target's geometry
            out.update(load_references(record, out["original_size"], target, out["crop_top_left"], flip,
                                       self.center_crop))
        return out

    def _pixels_or_latent(self, record: Record, rng: np.random.Generator, target: tuple[int, int],
                          flip: bool) -> dict[str, Any]:
        if self.latent_store is not None:
            cached = self._cached(record, target, flip)
            if cached is not None:
                return cached
        if record.frames:  # a clip: ingest sampled and sized it, so no crop (clips.py)
            return {"pixels": clip_pixels(record.frames, target, flip), "original_size": target,
                    "crop_top_left": (0, 0), "target_size": target, "mask": None,
                    "latent_key": latent_key(clip_digest(record.frames), target, flip)}
        data = record.path.read_bytes()
        with Image.open(io.BytesIO(data)) as im:
            pixels, original, crop = prepare_image(im, target, self.center_crop, flip, rng)
        mask = self.load_mask(record, original, target, crop, flip) if self.masks(record) else None
        key = (latent_key(hashlib.sha256(data).hexdigest(), target, flip, self.mask_digest(record))
               if self.center_crop else None)
        return {"pixels": pixels, "original_size": original, "crop_top_left": crop, "target_size": target,
                "latent_key": key, "mask": mask}

    def __getitem__(self, item: tuple[int, int]) -> dict[str, Any]:
        epoch, index = item
        rng = np.random.default_rng([self.seed, epoch, index])
        # The diffusion noise of each image (posterior sample, noise, timestep) is seeded per example
        # too, so a batch of 2b on one rank and b on each of two ranks train alike.
        noise_seeds = np.random.SeedSequence([self.seed, epoch, index, 1]).generate_state(2)
        group, i, c = self.layout.locate(index)
        target = self.target(index)
        instance = self._load("i", i, self.instances[i], rng, target)
        # unmasked_probability: a draw of its own (seed, epoch, index, 2), so the other draws stay as they are
        mask_off = bool(self.unmasked_probability) and bool(
            np.random.default_rng([self.seed, epoch, index, 2]).random() < self.unmasked_probability)
        example = {"instance": {**instance, "noise_seed": int(noise_seeds[0]), "mask_off": mask_off},
                   "instance_prompt": (group.prompt or self.prompt)(self.instances[i], rng),
                   "concept": self.instances[i].concept, "loss_weight": group.loss_weight}
        if c is not None:
            example["class"] = {**self._load("c", c, self.classes_[c], rng, target), "noise_seed": int(noise_seeds[1]),
                                "mask": None, "mask_off": True}  # prior preservation trains unmasked
            example["class_prompt"] = group.class_prompt or self.class_prompt
        return example


class EpochSampler(Sampler):
    """A permutation per epoch from (seed, epoch), yielding (epoch, index) for the dataset.

    The loop calls `set_epoch` before each pass; with accelerate's batch skipping this gives the
    exact data position on resume, and every rank derives the same order without communication.
    """

    def __init__(self, length: int, seed: int) -> None:
        self.length, self.seed, self.epoch = length, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[tuple[int, int]]:
        order = torch.randperm(self.length, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        return iter([(self.epoch, int(i)) for i in order])

    def __len__(self) -> int:
        return self.length


def collate(examples: list[dict[str, Any]]) -> Batch:
    """Stack a batch: instance images first, then class images (when present).

    `pixels` holds the decoded rows in order. When the data loader read rows from the disk latent
    cache, `cached_latents` has their posterior parameters (None for the decoded rows).
    """
    parts = [e["instance"] for e in examples]
    prompts = [e["instance_prompt"] for e in examples]
    if "class" in examples[0]:
        parts += [e["class"] for e in examples]
        prompts += [e["class_prompt"] for e in examples]
    weights = [e.get("loss_weight", 1.0) for e in examples] * (len(parts) // len(examples))
    decoded = [p["pixels"] for p in parts if p["pixels"] is not None]
    height, width = parts[0]["target_size"]
    return Batch(
        pixels=torch.stack(decoded) if decoded else torch.empty(0, 3, height, width),  # (clips: the same, stacked)
        cached_latents=[p.get("latent") for p in parts] if len(decoded) < len(parts) else None,
        prompts=prompts,
        latent_keys=[p["latent_key"] for p in parts],
        noise_seeds=[p["noise_seed"] for p in parts],
        geometry=Geometry(*(torch.tensor([p[k] for p in parts], dtype=torch.long)
                            for k in ("original_size", "crop_top_left", "target_size"))),
        num_instances=len(examples),
        concepts=[e.get("concept") for e in examples],  # of the instance rows (examples seen per concept)
        # an instance and its class image share their concept's weight
        loss_weights=torch.tensor(weights, dtype=torch.float32) if any(w != 1.0 for w in weights) else None,
        masks=[p.get("mask") for p in parts],
        mask_off=[bool(p.get("mask_off", True)) for p in parts],
        references=stack_references(parts),
    )
