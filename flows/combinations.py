"""Settings a later stage refuses for what another section says, refused when params.yaml loads.

Each stage checks its own section when it loads it (a bad value fails naming its key). A few
settings are refused by a later stage for what an earlier one wrote: `export.adapters: runtime`
cannot take a DoRA, LoKr or LoHa output, a full pipeline, an embedding, or a family whose LoRA keys
OpenVINO GenAI does not apply; the export stage would refuse them after the train stage had run.
`problems` names each such combination with both keys and the fix; `flows.params.check_params`
asks it, with every section loaded as its stage's typed config (so a section's own refusals, e.g.
bf16 inference with run-time adapters, fail there too), before any stage runs. The later stage's
own check stays, for a pipeline run by hand (`dvc repro`). What the base's family refuses (the train
stage's `check_family`, an export with no OpenVINO pipeline) is asked here too when the family is
known before the base stage runs (a built-in or a local folder). An edit dataset (tasks/common/
edit_data.py) refuses prior preservation and a base that takes no reference images. An explicit
bf16 that the train or class_images stage refuses on this machine's CPU (it would emulate bf16,
~500x slower: finetune_runtime/cpu_formats.py) is refused here too.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from finetune_runtime import cpu_formats
from tasks.common import edit_data, families
from tasks.common.adapters import adapter_type
from tasks.common.errors import UserError

FUSED = "or set export.adapters: fused"


def base_family(base: Any, root: Path) -> type[families.ModelFamily] | None:
    """The family of `base.model` when it is known before the base stage runs: a built-in, or a local
    diffusers folder; None for a hub id (the export stage checks it when it runs)."""
    model = str(getattr(base, "model", ""))
    if model in families.BUILTINS:
        return families.BUILTINS[model]
    folder = Path(model) if Path(model).is_absolute() else root / model
    return families.detect(folder) if (folder / "model_index.json").is_file() else None


def _runtime_method(train: Any) -> list[str]:
    """What the train stage writes must be a diffusers LoRA file of plain LoRA layers."""
    spec = train.spec
    if spec.output != "adapters":
        what = {"pipeline": "a full pipeline", "embedding": "a text embedding"}.get(spec.output, spec.output)
        return [f"export.adapters: runtime applies a LoRA file at run time, but train.method: {train.method} "
                f"writes {what}: set train.method: lora, {FUSED}"]
    if not adapter_type(train.lora_type).runtime:
        return [f"export.adapters: runtime cannot take train.lora_type: {train.lora_type} (OpenVINO GenAI applies "
                f"plain LoRA layers only): set train.lora_type: lora, {FUSED}"]
    return []


def _runtime_family(train: Any, family: type[families.ModelFamily] | None, model: str) -> list[str]:
    """The base's family must have its LoRA keys checked against GenAI, text encoders included."""
    if family is None or train.spec.output != "adapters":
        return []
    prefixes = family.export.genai_lora_prefixes
    if prefixes is None:
        return [f"export.adapters: runtime is not available for {family.title} (base.model: {model}; its LoRA "
                f"keys have not been checked against OpenVINO GenAI): set export.adapters: fused"]
    trained = family.text.trainable
    encoders = family.text.encoder_names if trained is None else trained
    if train.train_text_encoder and (extra := [n for n in encoders if n not in prefixes]):
        return [f"export.adapters: runtime cannot take train.train_text_encoder: true for {family.title} (base.model: "
                f"{model}): OpenVINO GenAI does not apply LoRA layers of {', '.join(extra)} at run time; set "
                f"train.train_text_encoder: false, {FUSED}"]
    return []


def runtime_adapters(configs: Mapping[str, Any], root: Path) -> list[str]:
    """`export.adapters: runtime` against the train method, adapter type and the base's family."""
    export, train, base = configs.get("export"), configs.get("train"), configs.get("base")
    if export is None or train is None or export.adapters != "runtime":
        return []
    family = base_family(base, root) if base is not None else None
    return _runtime_method(train) + _runtime_family(train, family, str(getattr(base, "model", "")))


def family_fits(configs: Mapping[str, Any], root: Path) -> list[str]:
    """What the base's family refuses, when it is known before the base stage runs: train.* settings it
    has not (the train stage's own `check_family`: method, adapter file format, options, prior
    preservation for a family that cannot make class images: Qwen-Image-Edit, LTX-Video; the class_images
    stage refuses it too) and an export optimum-intel has no pipeline for (FLUX.1 Kontext)."""
    train, export, base = configs.get("train"), configs.get("export"), configs.get("base")
    family = base_family(base, root) if base is not None else None
    if family is None:
        return []
    found = []
    if train is not None:
        try:
            train.check_family(family)
        except UserError as err:
            found.append(str(err))
    if export is not None and export.enabled and family.export.ov_pipeline is None:
        found.append(f"export.enabled: optimum-intel has no OpenVINO pipeline for {family.title} (base.model: "
                     f"{getattr(base, 'model', '')}): set export.enabled: false (evaluate and the registered "
                     "version then run the PyTorch fine-tune)")
    return found


def edit_dataset(configs: Mapping[str, Any], root: Path) -> list[str]:
    """An edit dataset (an ingest source with `control_dir` or `cond_image_column`): no prior preservation
    beside it (class images have no references: the train stage refuses it after class_images made them)
    and a base whose family trains on reference images, when the family is known before the base stage
    runs (the train stage refuses the others after ingest)."""
    ingest, train, base = configs.get("ingest"), configs.get("train"), configs.get("base")
    if ingest is None or not (keys := edit_data.reference_sources(ingest)):
        return []
    found = []
    if train is not None and (problem := edit_data.prior_preservation_problem(ingest, train.with_prior_preservation)):
        found.append(problem)
    family = base_family(base, root) if base is not None else None
    if family is not None and not family.inputs.trains:
        editors = ", ".join(f"{f.title}: {f.builtin}" for f in families.FAMILIES
                            if f.inputs.trains and getattr(f, "builtin", None))
        found.append(f"{keys[0]} makes an edit dataset (reference images), but {family.title} (base.model: "
                     f"{getattr(base, 'model', '')}) does not train on reference images; use a base that does "
                     f"({editors}), or ingest without {keys[0].rsplit('.', 1)[1]}")
    return found


def video_data(configs: Mapping[str, Any], root: Path) -> list[str]:
    """Clips (an ingest source of `type: clips`) train a video base only, and a video base trains on
    clips only, when the family is known before the base stage runs (the train stage refuses
    the other data after ingest)."""
    ingest, base = configs.get("ingest"), configs.get("base")
    family = base_family(base, root) if base is not None else None
    if ingest is None or family is None:
        return []
    clips = [f"ingest.sources[{i}]" for i, source in enumerate(ingest.sources) if source.type == "clips"]
    model = getattr(base, "model", "")
    if family.video and len(clips) < len(ingest.sources):
        others = [f"ingest.sources[{i}] (type: {s.type})" for i, s in enumerate(ingest.sources) if s.type != "clips"]
        return [f"base.model: {family.title} ({model}) trains on clips; {', '.join(others)} ingests images: use "
                "sources of type clips (the README's video recipe) or an image base"]
    if clips and not family.video:
        videos = ", ".join(f"{f.title}: {f.builtin}" for f in families.FAMILIES if f.video)
        return [f"{clips[0]} (type: clips) ingests video clips, but {family.title} ({model}) trains on images; use a "
                f"video base ({videos}) or image sources"]
    return []


#: The keys whose explicit bf16 the stage refuses on a CPU that would emulate it: (section, key, fix).
EXPLICIT_BF16 = (("train", "mixed_precision", "train.mixed_precision: auto or no (fp32)"),
                 ("class_images", "precision", "class_images.precision: auto or fp32"))


def emulated_bf16(configs: Mapping[str, Any], root: Path) -> list[str]:
    """An explicit bf16 (EXPLICIT_BF16) on this machine's CPU that would emulate it (no AVX512-BF16 or
    AMX-BF16: ~500x slower), as the train and class_images stages refuse it; none where a CUDA GPU
    computes (torch is imported only for such a key on such a CPU)."""
    asked = [(f"{section}.{key}", fix) for section, key, fix in EXPLICIT_BF16
             if getattr(configs.get(section), key, None) == "bf16"]
    if not asked or cpu_formats.detect().bf16:
        return []
    import torch

    if torch.cuda.is_available():
        return []
    return [problem for key, fix in asked if (problem := cpu_formats.emulated_bf16_problem(key, fix))]


#: Every rule: (the loaded sections by name, the repository root) -> problems.
RULES: tuple[Callable[[Mapping[str, Any], Path], list[str]], ...] = (runtime_adapters, family_fits, edit_dataset,
                                                                     video_data, emulated_bf16)


def problems(configs: Mapping[str, Any], root: Path) -> list[str]:
    """What RULES refuse in `configs` (each section of params.yaml as its stage's typed config)."""
    return [problem for rule in RULES for problem in rule(configs, root)]
