"""Settings that would change nothing: refused, naming the setting that does matter.

A key set away from its default where nothing reads it (a warm-up under the `constant` schedule,
a LoRA rank for DreamBooth, `ema_decay` without `use_ema`) trains exactly as without it, and the
run's params would claim otherwise. Three layers, each checked where its facts are known:

- `config_no_ops`: the train section alone (at load);
- `family_no_ops`: with the base model's family (before any weights load);
- `data_no_ops`: with the instance images' metadata (before the first step), e.g.
  `enable_bucket` over images that are all square, which trains one bucket.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tasks.train.method_specs import option_rules

#: key -> (does it matter for this config?, what makes it matter). Checked when the key is set
#: away from its default.
CONFIG_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "lr_warmup_steps": (lambda c: c.lr_scheduler != "constant",
                        "warm-up needs a schedule with one (lr_scheduler: constant_with_warmup, linear, cosine, "
                        "cosine_with_restarts or polynomial); 'constant' ignores it"),
    "lr_num_cycles": (lambda c: c.lr_scheduler == "cosine_with_restarts",
                      "only lr_scheduler: cosine_with_restarts has cycles"),
    "lr_power": (lambda c: c.lr_scheduler == "polynomial", "only lr_scheduler: polynomial has a power"),
    "ema_decay": (lambda c: c.use_ema, "needs use_ema: true"),
    "ema_update_every": (lambda c: c.use_ema, "needs use_ema: true"),
    "offload_ema": (lambda c: c.use_ema, "needs use_ema: true"),
    "prior_loss_weight": (lambda c: c.with_prior_preservation, "needs with_prior_preservation: true"),
    "validation_steps": (lambda c: c.num_validation_images > 0, "needs num_validation_images > 0"),
    **dict.fromkeys(("prodigy_beta3", "prodigy_decouple", "prodigy_use_bias_correction", "prodigy_safeguard_warmup"),
                    (lambda c: c.optimizer == "prodigy", "only optimizer: prodigy reads it")),
    **dict.fromkeys(("adam_beta1", "adam_beta2"), (lambda c: c.optimizer != "adafactor",
                                                   "optimizer: adafactor has no betas (its beta2 follows the step)")),
    "adam_epsilon": (lambda c: c.optimizer not in ("adafactor", "lion"),
                     "optimizer: adafactor and lion have no epsilon"),
}

#: flow-matching keys that only one timestep density reads
DENSITY_KEYS = {"logit_mean": "logit_normal", "logit_std": "logit_normal", "mode_scale": "mode",
                "sigmoid_scale": "sigmoid"}


def _set_away_from_default(cfg: Any, key: str) -> bool:
    return getattr(cfg, key) != type(cfg).model_fields[key].default


def config_no_ops(cfg: Any) -> list[str]:
    """`train.<key> is set, but <why>` for every key of CONFIG_RULES set where it does nothing."""
    return [f"{key} is set to {getattr(cfg, key)!r}, but {why}: remove it, or set what makes it matter"
            for key, (matters, why) in {**CONFIG_RULES, **option_rules()}.items()  # + the methods' own options
            if _set_away_from_default(cfg, key) and not matters(cfg)]


def family_no_ops(cfg: Any, family: Any) -> list[str]:
    """Density keys the timestep density never reads: `timestep_sampling`'s, else the weighting
    scheme's (the config's, else the family's own; sigma_sqrt, cosmap and none draw uniformly)."""
    own = family.denoiser.objective_options()  # the objective's settings where the config leaves them null
    if "weighting_scheme" not in own:
        return []  # an objective without schemes: families.refused_options(family) names these keys
    scheme = cfg.weighting_scheme or own["weighting_scheme"]
    if cfg.timestep_sampling:
        density, source = cfg.timestep_sampling, f"timestep_sampling: {cfg.timestep_sampling}"
    else:
        density = scheme if scheme in ("logit_normal", "mode") else "uniform"
        source = f"weighting_scheme {scheme!r}{'' if cfg.weighting_scheme else ', its default'}"
    return [f"train.{key} is set, but only a {needs} timestep density reads it ({family.title} samples with "
            f"{source}); remove it or set timestep_sampling: {needs}" if needs != "mode" else
            f"train.{key} is set, but only weighting_scheme: mode reads it ({family.title} samples with {source}); "
            "remove it or set weighting_scheme: mode"
            for key, needs in DENSITY_KEYS.items() if _set_away_from_default(cfg, key) and density != needs]


def data_no_ops(cfg: Any, sizes: Sequence[tuple[int, int]], tags_present: bool, captions_used: bool) -> list[str]:
    """Settings the data makes moot: `sizes` are the instance images' (height, width); `captions_used`:
    the prompts are the images' captions (not the instance prompt or textual inversion's templates)."""
    problems = []
    if cfg.enable_bucket and sizes and all(h == w for h, w in sizes):
        problems.append(
            f"train.enable_bucket is true, but all {len(sizes)} instance images are square, so every one trains in "
            f"the one square bucket, as without buckets. To train images whole at their aspect ratio, keep it in "
            f"ingest (ingest.output_size: short_side or source, not square); otherwise set enable_bucket: false")
    if cfg.shuffle_tag_p > 0 and not captions_used:
        problems.append(
            "train.shuffle_tag_p is set, but the prompts are not the images' captions (train.caption_column is null, "
            "so every image trains with instance_prompt; textual inversion uses its templates); set "
            "train.caption_column: text to train on tagged captions, or shuffle_tag_p: 0")
    elif cfg.shuffle_tag_p > 0 and not tags_present:
        problems.append(
            "train.shuffle_tag_p is set, but no instance image has tags to shuffle (metadata.jsonl 'tags': "
            "a metadata_json source stores them); set shuffle_tag_p: 0, or ingest tagged metadata")
    return problems
