"""What a version says it trained, from reports/train.json: its tags and its one line."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tasks.common.errors import UserError
from tasks.register.training import read_train_report, train_tags, trained_line


def test_lokr_with_text_encoders_and_two_concepts_in_one_line() -> None:
    report = {"method": "lora", "lora_type": "lokr", "rank": 8, "lora_alpha": 16.0, "train_text_encoder": True,
              "base_model_precision": "nf4-bnb", "text_encoder_precision": "int8-torchao", "optimizer": "adamw8bit",
              "instance_images": 5, "masked_loss": False,
              "concepts": {"dog": {"images": 4, "repeats": 2.0, "loss_weight": 1.0},
                           "cat": {"images": 1, "repeats": 1.0, "loss_weight": 0.5}}}
    assert trained_line(report) == (
        "LoKr r8 (alpha 16) with the text encoders on a base held in nf4-bnb (text encoders int8-torchao), "
        "adamw8bit, 5 images, 2 concepts: dog (4 images x2), cat (1 image x1, loss weight 0.5)")
    tags = train_tags(report)
    assert tags["train.lora_type"] == "lokr" and tags["train.masked_loss"] == "off"
    assert tags["train.concepts"] == "dog (4 images x2), cat (1 image x1, loss weight 0.5)"


def test_a_method_without_adapters_names_the_method() -> None:
    report = {"method": "full", "base_model_precision": "none", "optimizer": "adamw_bf16_stochastic",
              "instance_images": 1, "masked_loss": True, "masked_images": 1, "masked_loss_unmasked_weight": 0.2,
              "unmasked_probability": 0.1, "normalize_masked_area_loss": True}
    assert trained_line(report) == "full on a full-precision base, adamw_bf16_stochastic, 1 image (1 with masks)"
    assert "train.lora_type" not in train_tags(report)
    assert train_tags(report)["train.masked_loss"] == (
        "1 of 1 images (outside the mask weight 0.2, unmasked probability 0.1, area-normalised)")


def test_an_edit_run_says_how_many_pairs_it_trained() -> None:
    report = {"method": "lora", "lora_type": "lora", "rank": 4, "lora_alpha": 4.0, "base_model_precision": "none",
              "optimizer": "adamw", "instance_images": 4, "edit_pairs": 4}
    assert trained_line(report) == ("LoRA r4 (alpha 4) on a full-precision base, adamw, 4 images, 4 edit pairs "
                                    "(targets with reference images)")
    assert train_tags(report)["train.edit_pairs"] == 4
    assert "train.edit_pairs" not in train_tags(
        {k: v for k, v in report.items() if k != "edit_pairs"})


def test_a_report_that_is_not_the_train_stages_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="not found: run the train stage first"):
        read_train_report(tmp_path / "train.json")
    (tmp_path / "train.json").write_text(json.dumps([1]))
    with pytest.raises(UserError, match="expected the train stage's report"):
        read_train_report(tmp_path / "train.json")


def test_the_precision_that_ran_and_why_are_tagged_and_said() -> None:
    why = "auto: this CPU has no native bf16 (AVX2); bf16 would be emulated, about 500x slower than fp32"
    report = {"method": "lora", "lora_type": "lora", "rank": 4, "lora_alpha": 4.0, "base_model_precision": "int8",
              "optimizer": "adamw", "instance_images": 3, "mixed_precision": "no", "precision_why": why}
    assert trained_line(report) == "LoRA r4 (alpha 4) on a base held in int8, fp32, adamw, 3 images"
    tags = train_tags(report)
    assert tags["train.mixed_precision"] == "no" and tags["train.precision_why"] == why
    assert ", bf16 autocast, adamw" in trained_line({**report, "mixed_precision": "bf16"})
