"""Full fine-tune on a captioned dataset (diffusers' train_text_to_image.py, seed 001).

Trains every UNet weight (and the text encoders with `train_text_encoder`) on each image's own
caption (`caption_column`, default 'text'), with the tag and dropout rules from params. The
recipe's EMA (`use_ema`, optionally on the CPU), Min-SNR (`snr_gamma`), centre crop and random
flip are shared options of the loop. Saves a full pipeline folder (the EMA weights when on).
"""
from __future__ import annotations

from tasks.train.methods.base import TrainingMethod


class FullFineTune(TrainingMethod):
    name = "full"
