"""The `train` section: bad settings fail at config load, with the key and the fix in the message."""
from __future__ import annotations

import importlib.util

import pytest
import torch
import yaml

from tasks.common.config import parse_section
from tasks.common.errors import UserError
from tasks.train.config import NOT_IN_RUN_KEY, TrainConfig
from tests.conftest import REPO

pytestmark = pytest.mark.quick  # make test-fast


def load(**section) -> TrainConfig:
    return parse_section("train", section, TrainConfig)


def test_textual_inversion_needs_its_tokens_and_no_class_images() -> None:
    with pytest.raises(UserError, match="textual_inversion needs placeholder_token"):
        load(method="textual_inversion", with_prior_preservation=False)
    with pytest.raises(UserError, match="initializer_token"):
        load(method="textual_inversion", placeholder_token="<x>", with_prior_preservation=False)
    with pytest.raises(UserError, match="set with_prior_preservation: false"):
        load(method="textual_inversion", placeholder_token="<x>", initializer_token="toy")
    with pytest.raises(UserError, match="train_text_encoder: false"):
        load(method="textual_inversion", placeholder_token="<x>", initializer_token="toy",
             with_prior_preservation=False, train_text_encoder=True)
    assert load(method="textual_inversion", placeholder_token="<x>", initializer_token="toy",
                with_prior_preservation=False).num_vectors == 1


@pytest.mark.parametrize("setting, says", [
    (dict(lr_warmup_steps=2), "lr_warmup_steps is set to 2, but warm-up needs a schedule with one"),
    (dict(lr_scheduler="cosine", lr_num_cycles=3), "lr_num_cycles .* only lr_scheduler: cosine_with_restarts"),
    (dict(lr_scheduler="linear", lr_power=2.0), "lr_power .* only lr_scheduler: polynomial"),
    (dict(ema_decay=0.5), "ema_decay .* needs use_ema: true"),
    (dict(with_prior_preservation=False, prior_loss_weight=0.5), "prior_loss_weight .* with_prior_preservation"),
    (dict(num_validation_images=0, validation_steps=5), "validation_steps .* num_validation_images > 0"),
    (dict(method="dreambooth", rank=8), "rank is set to 8, but only method: lora reads it"),
    (dict(method="lora", num_vectors=2), "num_vectors .* only method: textual_inversion"),
])
def test_a_setting_that_would_change_nothing_is_refused(setting, says) -> None:
    with pytest.raises(UserError, match=says):
        load(**setting)


def test_the_same_settings_load_where_they_matter() -> None:
    assert load(lr_scheduler="linear", lr_warmup_steps=2).lr_warmup_steps == 2
    assert load(lr_scheduler="cosine_with_restarts", lr_num_cycles=3).lr_num_cycles == 3
    assert load(use_ema=True, ema_decay=0.5).ema_decay == 0.5
    assert load(method="lora", rank=8).rank == 8
    assert load(method="dreambooth", rank=4).rank == 4, "a default value is not a setting"


@pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 is valid where CUDA is present")
def test_fp16_on_cpu_fails_at_load() -> None:
    with pytest.raises(UserError, match=r"train: fp16 needs a CUDA GPU|mixed_precision fp16 needs a CUDA GPU"):
        load(mixed_precision="fp16")


def test_other_bad_settings_name_key_and_fix(tmp_path) -> None:
    with pytest.raises(UserError, match=r"train\.learning_rate"):
        load(learning_rate=-1)
    with pytest.raises(UserError, match=r"train\.max_train_step: unknown key"):
        load(max_train_step=3)
    with pytest.raises(UserError, match=r"train\.method"):
        load(method="dreambooth_lora")
    with pytest.raises(UserError, match="lr_warmup_steps"):
        load(max_train_steps=2, lr_warmup_steps=5)
    with pytest.raises(UserError, match="keep_tokens only matters with shuffle_tag_p"):
        load(keep_tokens=2)
    with pytest.raises(UserError, match="resume: .* is not a checkpoint folder; use latest"):
        load(resume=str(tmp_path / "checkpoint-5"))
    with pytest.raises(UserError, match="multiple of checkpointing_steps"):
        load(checkpointing_steps=10, keep_checkpoints_every_steps=25)
    with pytest.raises(UserError, match=r"train\.snr_gamma"):
        load(snr_gamma=0)
    if importlib.util.find_spec("bitsandbytes") is None:
        with pytest.raises(UserError, match="use_8bit_adam needs the bitsandbytes package"):
            load(use_8bit_adam=True)


@pytest.mark.parametrize("setting, says", [
    (dict(optimizer="lion", use_8bit_adam=True), "use_8bit_adam makes AdamW 8-bit, but optimizer is lion"),
    (dict(method="full", mixed_precision="bf16", full_bf16=True, optimizer="prodigy"),
     "full_bf16 updates bf16 weights with its own AdamW.*optimizer: prodigy .*set full_bf16: false"),
    (dict(method="full", mixed_precision="bf16", full_bf16=True, use_8bit_adam=True), "full_bf16 .*use_8bit_adam"),
    (dict(optimizer="schedulefree_adamw", use_ema=True), "optimizer: schedulefree_adamw .*set use_ema: false"),
    (dict(optimizer="schedulefree_adamw", lr_scheduler="cosine"), "schedulefree_adamw .*set lr_scheduler: constant"),
    (dict(optimizer="schedulefree_adamw", select_checkpoint="best", num_validation_images=1),
     "schedulefree_adamw .*set select_checkpoint: last"),
    (dict(prodigy_beta3=0.9), "prodigy_beta3 .* only optimizer: prodigy reads it"),
    (dict(optimizer="lion", prodigy_decouple=False), "prodigy_decouple .* only optimizer: prodigy"),
    (dict(optimizer="adafactor", adam_beta1=0.8), "adam_beta1 .* adafactor has no betas"),
    (dict(optimizer="lion", adam_epsilon=1e-6), "adam_epsilon .* lion have no epsilon"),
    (dict(optimizer="sgd"), r"train\.optimizer"),
])
def test_an_optimizer_that_cannot_work_is_refused_naming_the_key(setting, says) -> None:
    with pytest.raises(UserError, match=says):
        load(**setting)


def test_optimizers_and_their_options_load() -> None:
    assert load(optimizer="prodigy", learning_rate=1.0, prodigy_beta3=0.9).optimizer_choice == "prodigy"
    assert load(use_8bit_adam=True).optimizer_choice == "adamw8bit", "diffusers' spelling of adamw8bit"
    assert load(optimizer="schedulefree_adamw", lr_scheduler="constant_with_warmup",
                lr_warmup_steps=2).optimizer == "schedulefree_adamw"
    assert load(optimizer="lion", adam_beta2=0.99).adam_beta2 == 0.99
    assert load(method="full", mixed_precision="bf16", optimizer="adafactor").bf16_weights("cpu") is False, \
        "full_bf16's default (null) turns on for adamw only"


def test_scale_lr_follows_diffusers() -> None:
    cfg = load(learning_rate=2e-3, scale_lr=True, train_batch_size=2, gradient_accumulation_steps=3)
    assert cfg.effective_learning_rate(num_processes=4) == pytest.approx(2e-3 * 2 * 3 * 4)
    assert load(learning_rate=2e-3).effective_learning_rate(4) == 2e-3


def test_shipped_params_are_valid_and_the_surface_is_frozen() -> None:
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    shipped = parse_section("train", params["train"], TrainConfig)
    assert shipped.method == "dreambooth" and shipped.resolution == 64, "the demo: DreamBooth on the tiny model"
    assert set(TrainConfig.model_fields) >= NOT_IN_RUN_KEY
    # New options are a decision: adding one means updating this list (and params.yaml/README).
    assert sorted(TrainConfig.model_fields) == sorted([
        "method", "instance_prompt", "caption_column", "shuffle_tag_p", "keep_tokens", "proportion_empty_prompts",
        "class_prompt", "with_prior_preservation", "prior_loss_weight", "train_text_encoder",
        "placeholder_token", "initializer_token", "num_vectors", "learnable_property",
        "rank", "lora_alpha", "lora_dropout", "fuse_lora", "lora_type", "decompose_factor", "lora_format",
        "base_model_precision", "text_encoder_precision",
        "resolution", "center_crop", "random_flip", "train_batch_size", "dataloader_num_workers",
        "enable_bucket", "min_bucket_reso", "max_bucket_reso", "bucket_reso_steps", "aspect_ratio_buckets",
        "max_train_steps", "gradient_accumulation_steps", "gradient_checkpointing", "learning_rate", "scale_lr",
        "lr_scheduler", "lr_warmup_steps", "lr_num_cycles", "lr_power", "optimizer", "use_8bit_adam", "adam_beta1",
        "prodigy_beta3", "prodigy_decouple", "prodigy_use_bias_correction", "prodigy_safeguard_warmup",
        "adam_beta2", "adam_weight_decay", "adam_epsilon", "max_grad_norm", "mixed_precision", "full_bf16",
        "allow_tf32", "prediction_type", "snr_gamma", "noise_offset",
        "weighting_scheme", "logit_mean", "logit_std", "mode_scale", "guidance_scale", "max_sequence_length",
        "timestep_sampling", "sigmoid_scale", "timestep_shift", "first_frame_conditioning_p",
        "use_ema", "ema_decay", "offload_ema", "ema_update_every",
        "cache_latents", "cache_latents_to_disk", "cache_text_encoder_outputs_to_disk",
        "disk_cache_dir", "cache_text_encoder_outputs", "channels_last", "cpu_backend", "torch_compile", "xla",
        "checkpoints_dir", "checkpointing_steps", "checkpoints_total_limit", "keep_checkpoints_every_steps", "resume",
        "select_checkpoint", "checkpoint_scoring",
        "validation_prompts", "num_validation_images", "validation_steps", "validation_inference_steps",
        "log_every_steps", "system_metrics_interval", "seed", "launcher", "launch",
        "concepts",
        "masked_loss", "masked_loss_unmasked_weight", "unmasked_probability", "normalize_masked_area_loss",
    ])
