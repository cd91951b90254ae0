"""MLflow's own `diffusers` flavor on a registered LoRA version, beside the project's pyfunc.

MLflow 3.12+ has `mlflow.diffusers` for LoRA adapters on a pinned hub base
(`mlflow.diffusers.load_model(uri).load_pipeline()`), the form MLflow users look for. A version
whose fine-tune is a diffusers LoRA file (`train.lora_type` lora or dora, unfused or fused) on a
hub base (`base.model` a hub id with `base.revision` pinned) gets that flavor too: the same logged
model, its MLmodel naming the LoRA inside the pyfunc's `finetuned` artifact, the base's hub id and
commit. It does not fit a built-in or local base (the flavor keeps a hub id, not the weights) nor
LoKr/LoHa (the flavor loads with `load_lora_weights`): the pyfunc serves those.
"""
from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

from finetune_runtime.layout import LORA_WEIGHTS


@dataclass(frozen=True)
class HubBase:
    """The base a LoRA applies to, as the flavor records it."""

    model: str
    revision: str


def hub_reference(base_params: dict[str, Any]) -> HubBase | None:
    """The params' `base` section as a hub reference: a hub id with a pinned revision, else None
    (built-in models and local folders have no revision: the base stage refuses one for them)."""
    model, revision = base_params.get("model"), base_params.get("revision")
    if not isinstance(model, str) or model.startswith("builtin:") or not revision:
        return None
    return HubBase(model, str(revision))


def fits(finetuned: Path, base: HubBase | None) -> bool:
    """Whether the version can carry the flavor: a diffusers LoRA file on a hub base."""
    return base is not None and (Path(finetuned) / LORA_WEIGHTS).is_file()


class PyfuncWithDiffusersFlavor:
    """`Model.log(flavor=...)`: saves the pyfunc as mlflow.pyfunc does, then adds the `diffusers`
    flavor pointing at the LoRA file the pyfunc's `finetuned` artifact holds."""

    def __init__(self, base: HubBase) -> None:
        self.base = base

    def save_model(self, path: str, mlflow_model: Any, **kwargs: Any) -> None:
        import mlflow

        mlflow.pyfunc.save_model(path, mlflow_model=mlflow_model, **kwargs)
        weights = sorted(Path(path).glob(f"artifacts/*/{LORA_WEIGHTS}"))
        if len(weights) != 1:
            raise ValueError(f"expected one {LORA_WEIGHTS} among the model's artifacts, found {len(weights)}")
        mlflow_model.add_flavor(
            "diffusers", base_model=self.base.model, base_model_revision=self.base.revision,
            adapter_type="lora", adapter_weights=weights[0].parent.relative_to(path).as_posix(),
            weight_name=LORA_WEIGHTS, diffusers_version=version("diffusers"))
        mlflow_model.save(str(Path(path) / "MLmodel"))
