"""The `ingest` section of params.yaml: typed sources, image rules, caption policy, speed knobs.

`sources` is a list of mappings told apart by `type` (a pydantic discriminated union). Each source
type is strict on its own keys, and errors are reported at `ingest.sources.<i>.<key>` (pydantic
would otherwise put the union tag into the path, and list no known keys for a misspelt one).
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from tasks.common.concepts import concept_name_problem
from tasks.common.config import StageConfig
from tasks.common.safe_remove import own_folder
from tasks.ingest.annotate_config import CaptionerConfig, MaskerConfig

#: Options the seed's dataloader applies per batch; here they would bake one random draw into the
#: data, so the stage stores `tags` as a list and the train stage applies them.
TRAINING_TIME_KEYS = {
    "shuffle_tag_p": "tag shuffling",
    "keep_tokens": "keeping the first N tags",
    "keep_first_n_tags": "keeping the first N tags",
    "caption_dropout": "caption dropout",
    "caption_dropout_p": "caption dropout",
}


#: The most repeats a concept takes (a source's `repeats`, a kohya folder's `<repeats>_`): the train stage
#: lays an epoch out with each image listed `repeats` times, so a huge count would build a huge list.
#: The same cap as train.concepts' `repeats`.
MAX_REPEATS = 10_000


class ConceptFields(StageConfig):
    """What every source's rows say about their concept (several datasets trained in one run)."""

    concept: str | None = Field(
        None, min_length=1, max_length=128,
        description="the concept its images belong to (train.concepts names it); null: none",
    )
    repeats: int = Field(1, ge=1, le=MAX_REPEATS, description="times an epoch shows each of its images (kohya's)")

    @field_validator("concept")
    @classmethod
    def _concept_name(cls, name: str | None) -> str | None:
        if name is not None and (problem := concept_name_problem(name)):
            raise ValueError(problem)
        return name


class FolderSource(ConceptFields):
    """Images at any depth with sidecar captions (`name.txt`), or one prompt for all (DreamBooth)."""

    type: Literal["folder"]
    path: Path | None = Field(
        None, description="dataset root; nothing outside it is read; default: ingest.data_dir"
    )
    caption_extensions: tuple[str, ...] = Field(
        (".txt", ".caption"), min_length=1, description="sidecar caption names, first found wins"
    )
    instance_prompt: str | None = Field(
        None, min_length=1, description="caption for every image (sidecars are then ignored)"
    )
    kohya_folders: bool = Field(
        False, description="each sub-folder `<repeats>_<name>` (kohya's, e.g. `10_sks dog`) is a concept: "
        "`name` is its concept and the caption of its images without a sidecar, `repeats` its repeats",
    )

    @model_validator(mode="after")
    def _kohya_alone(self) -> FolderSource:
        if self.kohya_folders:
            clash = [k for k in ("concept", "instance_prompt") if getattr(self, k) is not None]
            clash += ["repeats"] if self.repeats != 1 else []
            if clash:
                raise ValueError(f"kohya_folders takes concept, repeats and captions from the sub-folders' names "
                                 f"(`<repeats>_<name>`): remove {', '.join(clash)}, or set kohya_folders: false")
        return self
    mask_dir: str | None = Field(
        None, min_length=1,
        description="folder of subject masks, relative to `path` (kohya's conditioning folder): an "
        "image's mask has its relative path and stem, any image extension (`masks/sub/a.png` for "
        "`sub/a.jpg`); files in it are never training images. `<stem>-masklabel.png` beside an "
        "image (OneTrainer) is read without it",
    )

    control_dir: str | None = Field(
        None, min_length=1,
        description="folder of reference (condition) images for edit training, relative to `path` (kohya's "
        "conditioning_data_dir, musubi-tuner's control_directory): a target's reference has its relative "
        "path and stem (`control/sub/a.png` for `sub/a.jpg`), several are numbered `a_0.png`, `a_1.png`, ...; "
        "a target without one is rejected (missing_reference); files in it are never training images",
    )

    @field_validator("mask_dir", "control_dir")
    @classmethod
    def _relative(cls, value: str | None) -> str | None:
        if value is not None and (Path(value).is_absolute() or ".." in Path(value).parts):
            raise ValueError(f"a folder inside the source's `path`, written relative to it (got {value!r})")
        return value

    @field_validator("caption_extensions")
    @classmethod
    def _dotted(cls, exts: tuple[str, ...]) -> tuple[str, ...]:
        bad = [e for e in exts if not e.startswith(".") or len(e) < 2]
        if bad:
            raise ValueError(f"extensions start with a dot, e.g. '.txt' (got {bad})")
        return tuple(e.lower() for e in exts)


class MetadataJsonSource(ConceptFields):
    """One JSON per image under `<path>/<metadata_dir>/` (any depth): `tags`, `score`, `path`.

    The filter rules carry the names of the training notes (seed 003) and apply in their order:
    consider_every_nth, abs_min_score, score_tags, tag_bonus_scores -> min_score,
    blacklist_tags, non_caption_tags, replacements, tag_separator.
    """

    type: Literal["metadata_json"]
    path: Path | None = Field(
        None,
        description="dataset root: JSON `path` values are relative to it; default: ingest.data_dir",
    )
    metadata_dir: str = Field("metadata", min_length=1, description="JSON files, under the root")
    consider_every_nth: int | None = Field(None, ge=1, description="only every nth JSON (sorted)")
    abs_min_score: float | None = Field(None, description="score below this: dropped at once")
    min_score: float | None = Field(None, description="score + tag bonuses below this: dropped")
    score_tags: list[int] = Field([], description="add tag scr<t> for the highest t <= score")
    tag_bonus_scores: dict[str, float] = Field({}, description="tag -> score added for min_score")
    blacklist_tags: list[str] = Field([], description="an image with any of these is dropped")
    non_caption_tags: list[str] = Field([], description="tags removed from the caption")
    replacements: dict[str, str] = Field({}, description="substring replacements, in order")
    tag_separator: str = Field(", ", description="joins the tags into the caption text")

    @model_validator(mode="before")
    @classmethod
    def _not_training_time(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key in TRAINING_TIME_KEYS.keys() & data.keys():
                raise ValueError(
                    f"'{key}' ({TRAINING_TIME_KEYS[key]}) is applied at training time, not at "
                    "ingest: the stage stores each image's tags as a list in metadata.jsonl; "
                    "remove the key here"
                )
        return data


class ImageFolderSource(ConceptFields):
    """A Hugging Face imagefolder: images plus metadata.jsonl / metadata.csv with `file_name`."""

    type: Literal["imagefolder"]
    path: Path | None = Field(
        None,
        description="dataset root; metadata files may sit at any depth; default: ingest.data_dir",
    )
    caption_column: str = Field("text", min_length=1, description="metadata column with captions")
    cond_image_column: str | None = Field(
        None, min_length=1, description="metadata column with each target's reference image(s) for edit "
        "training (diffusers' --cond_image_column): a path relative to the metadata file's folder, as "
        "`file_name`, or a list of them; null: no references",
    )


class HubSource(ConceptFields):
    """A dataset on the Hugging Face Hub, loaded with `datasets.load_dataset` (needs network).

    DVC cannot hash a hub dataset, so `revision` is required: pin a commit hash and the params
    change whenever the data may have changed ("main" works but is not reproducible).
    """

    type: Literal["hub"]
    name: str = Field(min_length=1, description="e.g. lambdalabs/pokemon-blip-captions")
    revision: str = Field(min_length=1, description="commit hash (or branch/tag) to load")
    subset: str | None = Field(None, description="dataset configuration name, if it has several")
    split: str = Field("train", min_length=1, description="the dataset split to read")
    image_column: str = Field("image", min_length=1, description="column with the images")
    caption_column: str = Field("text", min_length=1, description="column with the captions")
    cond_image_column: str | None = Field(
        None, min_length=1, description="column with each row's reference image (or a list of them) for "
        "edit training (diffusers' --cond_image_column); null: no references",
    )
    limit: int | None = Field(None, ge=1, description="read only the first N rows")


class ClipsSource(ConceptFields):
    """Video clips (mp4, webm, mov) and folders of frames at any depth, with sidecar captions
    (`clip.txt` beside `clip.mp4` or beside the frame folder `clip/`), or one prompt for all."""

    type: Literal["clips"]
    path: Path | None = Field(
        None, description="dataset root; nothing outside it is read; default: ingest.data_dir"
    )
    caption_extensions: tuple[str, ...] = Field(
        (".txt", ".caption"), min_length=1, description="sidecar caption names, first found wins"
    )
    instance_prompt: str | None = Field(
        None, min_length=1, description="caption for every clip (sidecars and metadata are then ignored)"
    )
    caption_column: str = Field(
        "text", min_length=1, description="the column holding captions in metadata.jsonl / metadata.csv files "
        "(any depth; `file_name`: the clip or frame folder, relative to the metadata file), as an imagefolder's",
    )
    frames_fps: float = Field(
        24.0, gt=0, le=1000, description="the rate a folder of frames was shot at (its frames in name order)"
    )

    _dotted = field_validator("caption_extensions")(FolderSource._dotted.__func__)


Source = Annotated[
    FolderSource | MetadataJsonSource | ImageFolderSource | HubSource | ClipsSource,
    Field(discriminator="type"),
]
SOURCE_TYPES: dict[str, type[StageConfig]] = {
    "folder": FolderSource,
    "metadata_json": MetadataJsonSource,
    "imagefolder": ImageFolderSource,
    "hub": HubSource,
    "clips": ClipsSource,
}


class Captions(StageConfig):
    """What happens to missing, empty and over-long captions."""

    fallback: str = Field("a photo of sks toy", min_length=1, description="the fallback prompt")
    empty: Literal["fallback", "drop"] = Field("fallback", description="missing or blank caption")
    max_words: int | None = Field(
        60, ge=1, description="longer captions follow `too_long` (CLIP reads ~75 tokens)"
    )
    too_long: Literal["truncate", "drop", "fallback"] = Field(
        "truncate", description="over max_words: cut to max_words (tags: whole tags) | drop the image | the fallback"
    )


class VideoConfig(StageConfig):
    """How clips (a `clips` source) are checked, sampled and bucketed (tasks/ingest/README.md, "Video clips")."""

    frames: tuple[int, ...] = Field(
        (9, 17, 25), min_length=1, description="frame counts a clip may be sampled to (the video VAE's: "
        "frame_step x k + 1); each clip gets the longest its duration holds at `fps`: its length bucket",
    )
    frame_step: int = Field(8, ge=1, le=64, description="the VAE's temporal compression: every count in "
                            "`frames` is frame_step x k + 1 (LTX-Video: 8)")
    fps: float = Field(8.0, gt=0, le=240, description="frames per second the samples are taken at")
    resolution: int = Field(128, ge=32, le=4096, description="each frame is resized and centre-cropped to its "
                            "aspect bucket: about resolution^2 pixels, sides multiples of bucket_step")
    bucket_step: int = Field(32, ge=1, le=256, description="bucket sides are multiples of this (the VAE's "
                             "spatial compression: 32 for LTX-Video)")
    max_seconds: float = Field(60.0, gt=0, le=86_400, description="a clip longer than this (by its header, "
                               "or by its packets when the header says nothing) is rejected (too_long)")
    max_pixels: int = Field(8_294_400, gt=0, description="a clip with more pixels per frame (from its header, "
                            "before decoding) is rejected (too_large); default 3840 x 2160")
    max_bytes: int = Field(256 * 1024 * 1024, gt=0, description="a clip file over this many bytes is rejected "
                           "unread (oversized_file)")
    decode_seconds: float = Field(30.0, gt=0, le=3600, description="wall-clock bound on one clip's checks and "
                                  "decoding (a confined child process); over it: decode_limit")
    decode_memory_mb: int = Field(1024, ge=256, le=65536, description="address-space bound of that child "
                                  "process in MiB; over it: decode_limit")

    @field_validator("frames")
    @classmethod
    def _sorted_unique(cls, frames: tuple[int, ...]) -> tuple[int, ...]:
        if any(f < 1 for f in frames):
            raise ValueError(f"frame counts are at least 1 (got {list(frames)})")
        return tuple(sorted(set(frames)))

    @model_validator(mode="after")
    def _vae_frames(self) -> VideoConfig:
        bad = [f for f in self.frames if (f - 1) % self.frame_step]
        if bad:
            fix = sorted({(f - 1) // self.frame_step * self.frame_step + 1 for f in bad})
            raise ValueError(f"frames {bad} are not frame_step x k + 1 (frame_step {self.frame_step}), which the "
                             f"video VAE needs; use e.g. {fix}")
        return self


class IngestConfig(StageConfig):
    """`ingest` section of params.yaml: where images come from and what is kept, and how."""

    data_dir: Path | None = Field(
        Path("data/demo/subject"),
        description="the folder of your images: DVC's dependency of the stage, through its manifest "
        "(dvc.yaml's data_manifest stage is given ${ingest.data_dir}); a local source without `path` "
        "reads it, and every local source "
        "must lie inside it. null: each local source names its own path (no DVC check)",
    )
    sources: list[Source] = Field(
        default_factory=lambda: [FolderSource(type="folder")],
        min_length=1,
        description="where the images come from: one or more sources, each with its `type`",
    )
    output_size: Literal["square", "short_side", "source"] = Field(
        "square",
        description="square: short side to `resolution`, then crop; short_side: resize, keep the "
        "aspect ratio; source: no resize (for aspect-ratio bucketing at training time)",
    )
    resolution: int = Field(64, gt=0, le=8192, description="short side after resizing")
    center_crop: bool = Field(True, description="square crop from the centre; false: top-left")
    background: tuple[int, int, int] = Field(
        (255, 255, 255), description="RGB that transparent pixels are composited onto"
    )
    min_side: int = Field(32, ge=1, description="images whose short side is smaller are rejected")
    max_pixels: int = Field(
        89_478_485, gt=0, description="images with more pixels are rejected (decompression bombs)"
    )
    max_aspect_ratio: float = Field(4.0, ge=1.0, description="long side / short side limit")
    near_duplicate_distance: int | None = Field(
        4, ge=0, le=64, description="perceptual-hash Hamming distance for near-duplicates; null: off"
    )
    captions: Captions = Captions()
    output_format: Literal["png", "jpeg"] = Field(
        "png", description="png: lossless; jpeg: quality `jpeg_quality`, 4:4:4, much faster"
    )
    jpeg_quality: int = Field(95, ge=1, le=100, description="quality of the files with output_format jpeg")
    workers: int | None = Field(None, ge=1, description="decoding processes; null: all CPUs")
    cache_dir: Path | None = Field(
        Path(".cache/ingest"), description="content-hash cache outside the outs; null: off. Pruning "
        "removes only the cache's own folders; the repository, an ancestor, / or home is refused"
    )
    video: VideoConfig = Field(
        VideoConfig(), description="clips of a `clips` source: frame count, fps, bucket size and the bounds "
        "on each file (tasks/ingest/README.md, \"Video clips\")",
    )
    captioner: CaptionerConfig | None = Field(
        None, description="captions made by a model at ingest (tasks/ingest/README.md); null: off"
    )
    masker: MaskerConfig | None = Field(
        None, description="subject masks made by CLIPSeg at ingest (tasks/ingest/README.md); null: off"
    )

    alpha_mask: bool = Field(
        False, description="an image's alpha channel is its subject mask (kohya's and ai-toolkit's "
        "name; a mask file wins); the RGB is still composited onto `background`",
    )
    invert_mask: bool = Field(False, description="invert every mask (ai-toolkit): 0 becomes the subject")
    mask_min_value: float = Field(
        0.0, ge=0.0, le=1.0, description="raise every mask pixel to at least this (0..1; ai-toolkit): "
        "the background keeps some weight",
    )

    @field_validator("cache_dir")
    @classmethod
    def _own_cache_dir(cls, path: Path | None) -> Path | None:
        return own_folder(path, ".cache/ingest")

    @field_validator("background")
    @classmethod
    def _rgb(cls, rgb: tuple[int, int, int]) -> tuple[int, int, int]:
        if not all(0 <= c <= 255 for c in rgb):
            raise ValueError(f"each channel is 0..255 (got {list(rgb)})")
        return rgb

    @model_validator(mode="wrap")
    @classmethod
    def _source_errors_at_their_index(cls, data: Any, handler: Any) -> IngestConfig:
        """Drop the union tag from error paths and list a source type's keys for unknown ones."""
        try:
            cfg = handler(data)
        except ValidationError as err:
            raise ValidationError.from_exception_data(
                cls.__name__, [_rewrite(e) for e in err.errors()]
            ) from None
        problems = _place_in_data_dir(cfg) + _no_op_settings(cfg) + _captioner_reachable(cfg)
        if problems:
            raise ValidationError.from_exception_data(cls.__name__, problems)
        return cfg


def _place_in_data_dir(cfg: IngestConfig) -> list[InitErrorDetails]:
    """Local sources without `path` read data_dir (filled in place: nobody has seen `cfg` yet);
    one outside data_dir, which DVC watches, is an error."""
    problems = []
    for i, src in enumerate(cfg.sources):
        if isinstance(src, HubSource):
            continue
        loc = ("sources", i, "path")
        if src.path is None and cfg.data_dir is None:
            kind = PydanticCustomError(
                "path_needed", "a '{kind}' source needs `path`, or ingest.data_dir set to the "
                "folder of your images", {"kind": src.type},
            )
            problems.append(InitErrorDetails(type=kind, loc=loc, input=None))
        elif src.path is None:
            cfg.sources[i] = src.model_copy(update={"path": cfg.data_dir})
        elif cfg.data_dir is not None and not _inside(src.path, cfg.data_dir):
            kind = PydanticCustomError(
                "outside_data_dir", "lies outside ingest.data_dir ({data_dir}), the folder DVC "
                "watches, so changes there would not rerun the stage. Move it into data_dir, or "
                "set data_dir to a folder that holds every local source (a source without `path` "
                "reads data_dir itself)", {"data_dir": cfg.data_dir.as_posix()},
            )
            problems.append(InitErrorDetails(type=kind, loc=loc, input=src.path.as_posix()))
    return problems


#: key -> (does it matter for this config?, what makes it matter); refused when set away from its default
NO_OP_RULES: dict[str, tuple[Any, str]] = {
    "center_crop": (lambda c: c.output_size == "square", "only output_size: square crops"),
    "resolution": (lambda c: c.output_size != "source", "output_size: source keeps every image's own size"),
    "jpeg_quality": (lambda c: c.output_format == "jpeg", "only output_format: jpeg has a quality"),
}


def _no_op_settings(cfg: IngestConfig) -> list[InitErrorDetails]:
    """A key set where it changes nothing (tasks/train/no_ops.py does the same for train)."""
    problems = []
    for key, (matters, why) in NO_OP_RULES.items():
        if getattr(cfg, key) != IngestConfig.model_fields[key].default and not matters(cfg):
            kind = PydanticCustomError("no_op", "is set, but {why}: remove it, or set what makes it matter",
                                       {"why": why})
            problems.append(InitErrorDetails(type=kind, loc=(key,), input=getattr(cfg, key)))
    return problems


def _captioner_reachable(cfg: IngestConfig) -> list[InitErrorDetails]:
    """captioner mode missing fills fallback captions; captions.empty: drop leaves none to fill."""
    if cfg.captioner is None or cfg.captioner.mode != "missing" or cfg.captions.empty != "drop":
        return []
    kind = PydanticCustomError(
        "captioner_unreachable", "captioner.mode: missing captions images without a caption, but "
        "captions.empty: drop drops them first, so it would never run. Set captions.empty: "
        "fallback (or captioner.mode: all)",
    )
    return [InitErrorDetails(type=kind, loc=("captioner", "mode"), input="missing")]


def _rewrite(error: Any) -> InitErrorDetails:
    loc = tuple(error["loc"])
    source_type = None
    if len(loc) >= 3 and loc[0] == "sources" and loc[2] in SOURCE_TYPES:
        source_type = str(loc[2])
        loc = (loc[0], loc[1], *loc[3:])
    if error["type"] == "extra_forbidden" and source_type and len(loc) == 3:
        known = ", ".join(sorted(SOURCE_TYPES[source_type].model_fields))
        kind = PydanticCustomError(
            "unknown_key", "unknown key (misspelt?). A '{kind}' source takes: {known}",
            {"kind": source_type, "known": known},
        )
        return InitErrorDetails(type=kind, loc=loc, input=error["input"])
    if error["type"] in ("union_tag_invalid", "union_tag_not_found"):
        kind = PydanticCustomError(
            "source_type", "each source needs `type`: one of {types}",
            {"types": ", ".join(SOURCE_TYPES)},
        )
        return InitErrorDetails(type=kind, loc=loc, input=error["input"])
    details = InitErrorDetails(type=error["type"], loc=loc, input=error["input"])
    if "ctx" in error:
        details["ctx"] = error["ctx"]
    return details


def _inside(path: Path, folder: Path) -> bool:
    path, folder = path.resolve(), folder.resolve()
    return path == folder or folder in path.parents


def local_root(source: Any) -> Path | None:
    """The folder a source reads (None for hub datasets, which are not on disk)."""
    return None if isinstance(source, HubSource) else Path(source.path)


def label(source: Any) -> str:
    """How reports name a source: its path as written in params, or the hub dataset name."""
    return source.name if isinstance(source, HubSource) else Path(source.path).as_posix()
