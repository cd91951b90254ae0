"""`only_if_changed`: has anything that makes a model changed since the last registered version?

The nightly deployment runs the flow with `only_if_changed=True`; with nothing new it must end in
seconds and register nothing. "Changed" is decided from what DVC and the registry already record,
never from timestamps:

1. `dvc status`: any stage whose code, data (new, edited or deleted files in a dependency folder),
   parameters or outputs differ from dvc.lock. With a DVC remote
   (flows/remote.py), outputs and deps that are only missing here (a new clone, an empty cache)
   are not changes: the run pulls them, as `dvc repro --allow-missing` would skip them.
   The data folder (`ingest.data_dir`) is versioned through its manifest (tasks/ingest/manifest.py,
   dvc.yaml's `data_manifest` stage, whose status is always "always changed"): the manifest is
   built here, opening nothing but regular files, and compared with the one dvc.lock records.
2. Every local folder source in `ingest.sources` must be a dependency of a stage in dvc.yaml (or
   inside the folder of a manifest one depends on); otherwise DVC cannot see its new files, so it
   counts as changed (and says why).
3. dvc.lock against the last registered version's lineage: the `inputs` (output hashes and stage
   params tasks/register reads from the same dvc.lock) of the version's lineage document, read
   from its own run (tasks/register/registry.py `read_lineage`), never its editable
   `lineage.fingerprint` tag: a forged tag cannot make the nightly say "up to date", and one that
   disagrees with the document is named in the summary. A workspace that is up to date with
   dvc.lock but whose outputs or parameters were never registered (a plain `dvc repro`, a failed
   registration) counts as changed; so does a last version without a readable lineage document
   (registered before lineage.json existed, or its document removed): what it was built from is
   unknown, and the reason says so.
4. No registered version of the model it registers under yet (`register.model_name`, or the name
   that follows what is trained: tasks/register/naming.py; not known before a hub base is
   downloaded): changed.
5. A last version whose registration was cut off after its creation (tag `registration=incomplete`,
   tasks/register/resume.py): changed, and the registration finishes that version.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from flows.dvc_stage import MISSING, dvc_status
from tasks.ingest.deps import interpolate, manifest_stages
from tasks.register.resume import INCOMPLETE, REGISTRATION_TAG, is_incomplete

#: The model version tag naming the DVC experiment a version was built in (flows/finetune.py).
EXPERIMENT_TAG = "dvc.experiment"
#: The version tag showing what it was built from (tasks/register/lineage.py writes it; display
#: only: the comparison reads the version's lineage document).
FINGERPRINT_TAG = "lineage.fingerprint"


@dataclass(frozen=True)
class Changes:
    changed: bool
    reasons: list[str] = field(default_factory=list)
    compared_with: str | None = None  # "sd-dreambooth v3", when a registered version was found
    notes: list[str] = field(default_factory=list)  # e.g. a tag that disagrees with the lineage

    def summary(self) -> str:
        notes = "".join(f" (note: {n})" for n in self.notes)
        if not self.changed:
            return f"up to date: nothing changed since {self.compared_with}{notes}"
        return "changed: " + "; ".join(self.reasons) + notes


def _status_reasons(status: dict[str, Any], allow_missing: bool = False) -> list[str]:
    reasons = []
    for stage, entries in status.items():
        parts = []
        for entry in entries:
            if isinstance(entry, dict):
                for kind, what in entry.items():  # {"changed deps": {"data/x": "modified"}}
                    if allow_missing and isinstance(what, dict):
                        # A params file's entry is a dict of its changed keys, never "missing".
                        what = {k: v for k, v in what.items()
                                if not (isinstance(v, str) and v in MISSING)}
                        if not what:
                            continue
                    items = ", ".join(f"{k} {v}" for k, v in what.items()) if isinstance(what, dict) else what
                    parts.append(f"{kind}: {items}")
            else:
                parts.append(str(entry))
        if parts:
            reasons.append(f"stage '{stage}': " + "; ".join(parts))
    return reasons


def unwatched_sources(root: Path) -> list[str]:
    """Local folder sources in params.yaml's ingest.sources that no dvc.yaml stage depends on."""
    params = yaml.safe_load((root / "params.yaml").read_text()) or {}
    stages = (yaml.safe_load((root / "dvc.yaml").read_text()) or {}).get("stages") or {}
    deps = set()
    for stage in stages.values():
        for dep in stage.get("deps") or []:
            dep = interpolate(str(dep), params)  # `${ingest.data_dir}` as DVC fills it in
            if dep is not None:
                deps.add(Path(dep).as_posix().rstrip("/"))
    # A dependency on a data manifest (tasks/ingest/manifest.py) watches the folder it lists.
    deps |= {Path(m.data).as_posix().rstrip("/") for m in manifest_stages(stages, params)
             if Path(m.out).as_posix() in deps}
    missing = []
    ingest = params.get("ingest") or {}
    for source in ingest.get("sources") or []:
        # A local source without `path` reads ingest.data_dir.
        path = source.get("path", ingest.get("data_dir")) if isinstance(source, dict) else None
        if not path or source.get("type") == "hub" or "://" in str(path):
            continue
        norm = Path(str(path)).as_posix().rstrip("/")
        if not any(norm == d or norm.startswith(d + "/") for d in deps):
            missing.append(norm)
    return missing


def manifest_changes(root: Path) -> tuple[set[str], list[str]]:
    """The data manifest stages of dvc.yaml (their `dvc status` is always "always changed"), and
    a reason for each whose folder differs now from the manifest dvc.lock records: the manifest
    is built here as its stage would build it (lstat only, regular files hashed), never by DVC."""
    import hashlib

    from tasks.ingest import manifest

    params = yaml.safe_load((root / "params.yaml").read_text()) or {}
    stages = (yaml.safe_load((root / "dvc.yaml").read_text()) or {}).get("stages") or {}
    lock_path = root / "dvc.lock"
    lock = (yaml.safe_load(lock_path.read_text()) or {}).get("stages") or {} if lock_path.is_file() else {}
    names, reasons = set(), []
    for found in manifest_stages(stages, params):
        names.add(found.name)
        outs = {str(o.get("path")): o.get("md5") for o in (lock.get(found.name) or {}).get("outs") or []}
        state = manifest.read_state(root / found.state) if found.state else None
        now = hashlib.md5(manifest.dumps(manifest.build(root / found.data, state, warn=lambda _: None)))
        # DVC hashes text files with CRLF turned into LF; the manifest has no CR, so md5 is the same.
        if outs.get(found.out) != now.hexdigest():
            reasons.append(f"stage '{found.name}': the data folder {found.data} differs from the manifest "
                           f"dvc.lock records ({found.out}): new, edited or removed files")
    return names, reasons


def lineage_of_workspace(root: Path) -> dict[str, str] | None:
    """What a registration of the workspace would be built from now, flat (None: no dvc.lock):
    `dvc.md5.<out>` and `param.<key>` (tasks/register/lineage.py `inputs`)."""
    from tasks.register.lineage import inputs, read_lock

    if not (root / "dvc.lock").is_file():
        return None
    return inputs(read_lock(root / "dvc.lock", required=()))


def registered_lineage(client: Any, version: Any, label: str) -> tuple[dict[str, str] | None, list[str]]:
    """The `inputs` of a version's lineage document (None: it cannot be read, the first line says
    why), and notes on a `lineage.fingerprint` tag that disagrees with the document."""
    from tasks.register.lineage import fingerprint
    from tasks.register.registry import read_lineage

    doc, problem = read_lineage(client, version)
    if doc is not None and not isinstance(doc.get("inputs"), dict):
        doc, problem = None, "its lineage document names no inputs"
    if doc is None:
        return None, [f"what {label} was built from is unknown: {problem}"]
    then = {str(k): str(v) for k, v in doc["inputs"].items()}
    tagged = (version.tags or {}).get(FINGERPRINT_TAG)
    if tagged is not None and tagged != fingerprint(then):
        return then, [f"{label}'s tag {FINGERPRINT_TAG}={tagged} disagrees with its lineage "
                      f"document ({fingerprint(then)}); the document is used"]
    return then, []


def last_registered(client: Any, model_name: str, include_experiments: bool = True) -> Any | None:
    """The newest version of `model_name` (highest number), or None when there is none.

    Without `include_experiments`, versions registered from a DVC experiment (flow overrides,
    tag `dvc.experiment`) are passed over: they were not built from the workspace's params.yaml.
    """
    versions = client.search_model_versions(f"name='{model_name}'")
    if not include_experiments:
        versions = [v for v in versions if EXPERIMENT_TAG not in (v.tags or {})]
    return max(versions, key=lambda v: int(v.version)) if versions else None


def _diff(now: dict[str, str], then: dict[str, str]) -> list[str]:
    keys = sorted(set(now) | set(then))
    diffs = [k for k in keys if now.get(k) != then.get(k)]
    shown = ", ".join(f"{k}: {then.get(k, '(none)')} -> {now.get(k, '(none)')}" for k in diffs[:5])
    more = f" and {len(diffs) - 5} more" if len(diffs) > 5 else ""
    return [f"{shown}{more}"] if diffs else []


def detect_changes(root: Path, model_name: str | None, tracking_uri: str,
                   include_experiments: bool = False, allow_missing: bool = False) -> Changes:
    """Compare the workspace (dvc status, dvc.lock, sources) with the last registered version
    (with `include_experiments`, one registered from a DVC experiment counts too; with
    `allow_missing`, data only missing here is no change)."""
    manifests, reasons = manifest_changes(root)
    status = {stage: [e for e in entries if not (stage in manifests and e == "always changed")]
              for stage, entries in dvc_status(root).items()}
    reasons += _status_reasons(status, allow_missing)
    reasons += [f"source folder {p} is not a dependency of any stage in dvc.yaml, so DVC cannot "
                "tell whether it has new files (add it to the ingest stage's deps)"
                for p in unwatched_sources(root)]
    from mlflow import MlflowClient

    if model_name is None:
        reasons.append("the registered model's name follows the base's family, which is not known before "
                       "the base stage runs (or set register.model_name)")
        return Changes(True, reasons)
    client = MlflowClient(tracking_uri=tracking_uri)
    version = last_registered(client, model_name, include_experiments)
    if version is None:
        reasons.append(f"no version of model '{model_name}' is registered yet")
        return Changes(True, reasons)
    label = f"{model_name} v{version.version}"
    if is_incomplete(version):
        reasons.append(f"the registration of {label} was cut off after the version was created "
                       f"(tag {REGISTRATION_TAG}={INCOMPLETE}); this run finishes it")
        return Changes(True, reasons, label)
    now = lineage_of_workspace(root)
    then, notes = registered_lineage(client, version, label)
    if now is None:
        reasons.append("dvc.lock is missing: the pipeline has not run in this workspace")
    elif then is None:
        reasons.append(notes.pop(0))
    elif diff := _diff(now, then):
        reasons.append(f"dvc.lock differs from the lineage of {label}: {diff[0]}")
    return Changes(bool(reasons), reasons, label, notes)
