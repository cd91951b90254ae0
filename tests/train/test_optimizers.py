"""Every optimizer `train.optimizer` adds on the tiny SD model: six steps, and the same run resumed
from its third step's checkpoint, give the same weights and losses bit for bit (the optimizer's
state travels in the checkpoint). AdamW's exact resume: tests/train/test_resume.py."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tasks.train.config import TrainConfig
from tasks.train.core import train

LORA = "pytorch_lora_weights.safetensors"
#: a learning rate each optimizer moves at in six steps (Prodigy's multiplies its own estimate)
RATES = {"prodigy": 1.0, "adafactor": 1e-2, "schedulefree_adamw": 1e-3, "lion": 1e-4}


@pytest.mark.parametrize("optimizer", sorted(RATES))
def test_six_steps_equal_three_plus_resume_plus_three(tmp_path, tiny_sd, instance_dir, optimizer) -> None:
    kw = dict(method="lora", rank=4, max_train_steps=6, train_batch_size=1, resolution=32, num_validation_images=0,
              with_prior_preservation=False, learning_rate=RATES[optimizer], optimizer=optimizer,
              checkpointing_steps=3, checkpoints_total_limit=None, fuse_lora=False, checkpoints_dir=tmp_path / "ckpt")
    straight = train(TrainConfig(**kw, resume="none"), tiny_sd, instance_dir, None, tmp_path / "straight")
    third = straight.checkpoint_dir / "checkpoint-3"  # saved on the way; the run goes on from it
    resumed = train(TrainConfig(**kw, resume=str(third)), tiny_sd, instance_dir, None, tmp_path / "resumed")
    assert resumed.resumed_from == 3 and [h.step for h in resumed.history] == [4, 5, 6]
    assert [h[1] for h in resumed.losses] == [h[1] for h in straight.losses]
    a, b = load_file(tmp_path / "straight" / LORA), load_file(tmp_path / "resumed" / LORA)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "bit for bit"
    assert all(a[k].abs().sum() > 0 for k in a if ".up." in k), "the adapters trained (up matrices start at zero)"
    assert straight.report()["optimizer"] == optimizer
