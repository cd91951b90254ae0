"""Which registered model a fine-tune goes to: one name per lineage of comparable models.

A champion is compared with the versions that follow it on one yardstick: the same model family,
trained for the same task, so the name follows what was trained. With `register.model_name` unset
(params.yaml's default) it is `<family>-<method>`, with `-edit` before the method when the data is an
edit set (targets trained with reference images): `sd-dreambooth`, `sd-lora`, `zimage-lora`,
`flux2-edit-lora`, `kontext-edit-lora` (`qwenimage-edit-lora`: the family's name says it). A name
set in params.yaml is used as it is (`sd-finetuned`, the default before names followed the
lineage, keeps working where it is set).

Whatever the name, a candidate whose family or task differs from the champion's is never ranked
against it (tasks/register/promotion.py, `Lineage.differs`): under a name set by hand and shared by
two families, the champion holds and the decision says why in one line.

What was trained is read from the train stage's report (`family`, `method`, `edit_pairs`), never
from params.yaml as edited since; before the stages ran (the flow's `only_if_changed`, `make
serve-model`) from params.yaml: the family of a built-in base, or of the base folder's
model_index.json, and `train.method`.

    python -m tasks.register.naming [--params params.yaml]   # prints the name a run registers under
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.common.config import read_params
from tasks.common.errors import UserError

TEXT_TO_IMAGE = "text-to-image"
EDIT = "edit"


@dataclass(frozen=True)
class Lineage:
    """What a version is, for ranking: its family (`sd`, `zimage`, ...; None: unknown), its task
    (text-to-image or edit) and its training method."""

    family: str | None
    task: str | None
    method: str | None = None

    def says(self) -> str:
        """`sd text-to-image`, `kontext edit`, `unknown family text-to-image`."""
        return f"{self.family or 'unknown family'} {self.task or 'unknown task'}"

    def differs(self, other: Lineage) -> bool:
        """True when both are known and the family or the task differs (unknown: no opinion, so a
        champion registered before versions recorded their lineage is still compared with)."""
        pairs = ((self.family, other.family), (self.task, other.task))
        return any(a is not None and b is not None and a != b for a, b in pairs)

    def default_name(self) -> str | None:
        """`<family>[-edit]-<method>`; None when the family or the method is unknown."""
        if not self.family or not self.method:
            return None
        said = self.task == EDIT and EDIT not in self.family.split("-")  # qwenimage-edit says it already
        name = "-".join([self.family, *([EDIT] if said else []), self.method])
        return re.sub(r"[^A-Za-z0-9.-]+", "-", name).strip("-.").lower()

    def record(self) -> dict[str, str | None]:
        """lineage.json's `lineage` section."""
        return {"family": self.family, "task": self.task, "method": self.method}


def of_training(trained: dict[str, Any] | None, family: str | None = None, method: str | None = None) -> Lineage:
    """The lineage of a fine-tune: from the train stage's report when there is one, else `family`
    (detected from the fine-tune's folder) and `method` (dvc.lock's `train.method`); the task is
    unknown without a report."""
    if not trained:
        return Lineage(family, None, method)
    return Lineage(str(trained.get("family") or family or "") or None,
                   EDIT if trained.get("edit_pairs") else TEXT_TO_IMAGE,
                   str(trained.get("method") or method or "") or None)


def of_record(doc: dict[str, Any]) -> Lineage | None:
    """A registered version's lineage, from its lineage document: the `lineage` section, or for a
    version registered before it existed, its train section and the built-in base it names; None
    when it says neither family nor task."""
    found = _recorded(doc)
    return found if found.family or found.task else None


def _recorded(doc: dict[str, Any]) -> Lineage:
    from tasks.common.families import BUILTINS

    section = doc.get("lineage")
    if isinstance(section, dict):
        return Lineage(section.get("family"), section.get("task"), section.get("method"))
    trained = doc.get("train") if isinstance(doc.get("train"), dict) else {}
    params = doc.get("params") if isinstance(doc.get("params"), dict) else {}
    base = str((params.get("base") or {}).get("model", ""))
    family = trained.get("family") or (BUILTINS[base].name if base in BUILTINS else None)
    method = trained.get("method") or (params.get("train") or {}).get("method")
    task = (EDIT if trained.get("edit_pairs") else TEXT_TO_IMAGE) if trained else None
    return Lineage(family, task, method)


def family_of_folder(path: Path | None) -> str | None:
    """The family of a diffusers or OpenVINO pipeline folder; None when it is not one (yet)."""
    from tasks.common import families

    if path is None or not (Path(path) / "model_index.json").is_file():
        return None
    try:
        return families.detect(Path(path)).name
    except UserError:
        return None


def model_name(configured: str | None, lineage: Lineage) -> str:
    """`register.model_name` when set, else the lineage's default name; a UserError naming the key
    when neither is known."""
    if configured:
        return configured
    name = lineage.default_name()
    if name is None:
        raise UserError(f"register.model_name is not set and the name cannot follow what was trained "
                        f"(family {lineage.family or 'unknown'}, method {lineage.method or 'unknown'}): "
                        "pass the train stage's report (--train-report reports/train.json), or set "
                        "register.model_name in params.yaml")
    return name


def planned(params: Path = Path("params.yaml"), train_report: Path | None = Path("reports/train.json"),
            base: Path | None = Path("models/base")) -> str | None:
    """The name a run of this workspace registers under, before or after its stages: the set
    `register.model_name`; else the train report's lineage when its method and base are still
    params.yaml's; else params.yaml's built-in base (or `base`'s folder) and `train.method`.
    None when the family cannot be known yet (a hub base not downloaded)."""
    from tasks.common.families import BUILTINS

    values = read_params(params)
    configured = (values.get("register") or {}).get("model_name")
    if configured:
        return str(configured)
    model = str((values.get("base") or {}).get("model", ""))
    method = (values.get("train") or {}).get("method")
    family = BUILTINS[model].name if model in BUILTINS else family_of_folder(base)
    report = _report(train_report)
    if report and report.get("method") == method and (family is None or report.get("family") == family):
        return of_training(report).default_name()
    return Lineage(family, TEXT_TO_IMAGE, method).default_name()


def _report(path: Path | None) -> dict[str, Any] | None:
    if path is None or not Path(path).is_file():
        return None
    try:
        data = json.loads(Path(path).read_text())
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def main() -> None:
    """Print the name (nothing else: `make serve-model` reads it); an error in one line, exit 2."""
    try:
        print(_main())
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


def _main() -> str:
    parser = argparse.ArgumentParser(prog="python -m tasks.register.naming", description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    parser.add_argument("--train-report", type=Path, default=Path("reports/train.json"))
    parser.add_argument("--base", type=Path, default=Path("models/base"))
    args = parser.parse_args()
    name = planned(args.params, args.train_report, args.base)
    if name is None:
        raise UserError("the registered model's name follows the base's family, which is not known until the "
                        "base stage ran (dvc repro base); or set register.model_name in params.yaml")
    return name


if __name__ == "__main__":
    main()
