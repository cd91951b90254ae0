"""What each step trains on: prompts and captions, prior preservation, image size, crops and
buckets, the batch, several concepts, masks."""
from __future__ import annotations

from pydantic import Field

from tasks.common.config import StageConfig
from tasks.train.concepts import ConceptConfig


class DataSection(StageConfig):
    # prompts and captions
    instance_prompt: str = Field("a photo of sks toy", min_length=1, description="prompt with the unique identifier")
    caption_column: str | None = Field(
        None, min_length=1,
        description="metadata.jsonl column with per-image captions; null: instance_prompt for every image "
                    "(method full, and an edit dataset: 'text', each target's caption, its instruction)",
    )
    shuffle_tag_p: float = Field(0.0, ge=0.0, le=1.0, description="chance to shuffle an image's tags")
    keep_tokens: int = Field(0, ge=0, description="the first N tags stay in place when shuffling")
    proportion_empty_prompts: float = Field(0.0, ge=0.0, lt=1.0, description="caption dropout: chance of ''")
    # prior preservation (DreamBooth; also usable as regularisation by lora and full)
    class_prompt: str = Field("a photo of a toy", min_length=1, description="prompt of the class images")
    with_prior_preservation: bool = Field(
        True, description="add the prior-preservation loss over class images (false: the class_images stage makes "
                          "none; an edit dataset refuses true: class images have no reference images)")
    prior_loss_weight: float = Field(1.0, ge=0.0, description="weight of the prior-preservation loss")
    # images
    resolution: int = Field(64, ge=8, le=4096, multiple_of=8, description="training images are resized/cropped to this")
    center_crop: bool = Field(True, description="centre crop (false: random crop)")
    random_flip: bool = Field(False, description="flip images horizontally at random")
    # aspect-ratio buckets (kohya sd-scripts' names; a fixed list as diffusers' aspect_ratio_buckets)
    enable_bucket: bool = Field(False, description="train each image whole in the bucket nearest its aspect ratio")
    min_bucket_reso: int | None = Field(None, ge=8, description="shortest bucket side; null: resolution / 2")
    max_bucket_reso: int | None = Field(None, ge=8, description="longest bucket side; null: resolution x 2")
    bucket_reso_steps: int | None = Field(
        None, ge=8, multiple_of=8, description="bucket sides are multiples of this; null: 64 (8 below resolution 256)"
    )
    aspect_ratio_buckets: str | list[tuple[int, int]] | None = Field(
        None, description="a fixed bucket list, 'h,w;h,w' or [[h, w], ...] (diffusers); replaces the kohya rule"
    )
    # the batch
    train_batch_size: int = Field(2, ge=1, le=4096, description="instance images per device per step")
    dataloader_num_workers: int = Field(0, ge=0, le=64, description="data loader worker processes (0: in the main one)")
    # several concepts in one run (kohya's subsets, OneTrainer's concepts)
    concepts: list[ConceptConfig] = Field(
        [], description="datasets trained together, each with its prompts, class images, repeats and loss "
                        "weight; empty: one dataset (instance_prompt / captions, class_prompt, the rows' repeats)",
    )
    # masked training (tasks/train/README.md "Masked training"; masks from the ingest stage)
    masked_loss: bool = Field(
        False, description="weight the loss by each image's subject mask (kohya's name): the background is not "
        "learned; needs masks from the ingest stage (mask_dir, -masklabel.png, alpha_mask)",
    )
    masked_loss_unmasked_weight: float = Field(
        0.0, ge=0.0, le=1.0, description="loss weight of the pixels outside the mask (OneTrainer's unmasked_weight)"
    )
    unmasked_probability: float = Field(
        0.0, ge=0.0, le=1.0, description="chance that an example trains unmasked (OneTrainer's name; "
        "SimpleTuner's masked_loss_probability is 1 minus this), drawn per example and epoch",
    )
    normalize_masked_area_loss: bool = Field(
        False, description="divide each example's loss by its mask's mean weight, so a small subject "
        "weighs as much as a large one (OneTrainer's name)",
    )

    def _data_problem(self) -> str | None:
        mask_options = {"masked_loss_unmasked_weight": self.masked_loss_unmasked_weight,
                        "unmasked_probability": self.unmasked_probability,
                        "normalize_masked_area_loss": self.normalize_masked_area_loss}
        if not self.masked_loss and (on := [k for k, v in mask_options.items() if v]):
            return f"{', '.join(on)} only act(s) with masked_loss: true; set masked_loss: true or remove them"
        if self.keep_tokens and not self.shuffle_tag_p:
            return "keep_tokens only matters with shuffle_tag_p > 0"
        return self._bucket_problem()

    def _bucket_problem(self) -> str | None:
        if not self.enable_bucket:
            keys = ("min_bucket_reso", "max_bucket_reso", "bucket_reso_steps", "aspect_ratio_buckets")
            if set_keys := [k for k in keys if getattr(self, k) is not None]:
                return f"{', '.join(set_keys)} only matter with enable_bucket: true"
            return None
        try:
            buckets = self.buckets()
        except ValueError as err:
            return f"aspect_ratio_buckets: {err} (write 'h,w;h,w' or a list of [h, w], sides multiples of 8)"
        if bad := [b for b in buckets if b[0] % 8 or b[1] % 8 or min(b) < 8]:
            return f"aspect_ratio_buckets: {bad} are not multiples of 8 (the VAE downsamples by 8)"
        lo, hi, step = self.bucket_shape()
        if self.aspect_ratio_buckets is None and not lo <= self.resolution <= hi:
            return f"min_bucket_reso {lo} <= resolution {self.resolution} <= max_bucket_reso {hi} must hold"
        if self.aspect_ratio_buckets is None and (lo % step or hi % step):
            return f"min_bucket_reso {lo} and max_bucket_reso {hi} must be multiples of bucket_reso_steps {step}"
        return None

    def bucket_shape(self) -> tuple[int, int, int]:
        """(min_bucket_reso, max_bucket_reso, bucket_reso_steps) with the defaults filled in."""
        step = self.bucket_reso_steps or (64 if self.resolution >= 256 else 8)
        lo = self.min_bucket_reso or max(step, self.resolution // 2 // step * step)
        return lo, self.max_bucket_reso or self.resolution * 2, step

    def buckets(self) -> list[tuple[int, int]]:
        """The (height, width) buckets: the fixed list, or kohya's rule from the bucket options."""
        from tasks.train.buckets import kohya_buckets, parse_buckets

        if self.aspect_ratio_buckets is not None:
            return parse_buckets(self.aspect_ratio_buckets)
        return kohya_buckets(self.resolution, *self.bucket_shape())
