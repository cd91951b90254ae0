"""Keep dvc.yaml honest: under `dvc repro`, every local source folder must be a dependency.

dvc.yaml's ingest stage depends on the manifest of `${ingest.data_dir}` (DVC fills it in from
params.yaml), which stands for that folder here (tasks/ingest/manifest.py: DVC hashing the folder
itself would open every file in it, a FIFO included), and the config keeps every local source
inside data_dir. DVC 3 cannot template a list from params into `deps` (`deps: ${ingest.paths}`
fails with "Cannot interpolate data of type 'list'", treeverse/dvc#8171), hence the one folder.
Should dvc.yaml be edited so that a source is not inside a dependency, adding images to it would
not rerun the stage and the pipeline would silently train on stale data. DVC sets DVC_ROOT and
DVC_STAGE for the commands it runs; with them set, this check reads the stage's deps and fails
with the exact line to add. Run by hand (no DVC_STAGE) the stage does not check.
"""
from __future__ import annotations

import argparse
import logging
import os
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tasks.common.errors import UserError
from tasks.ingest import manifest
from tasks.ingest.config import HubSource, IngestConfig

log = logging.getLogger(__name__)

_TEMPLATE = re.compile(r"\$\{\s*([^}]+?)\s*\}")


def interpolate(text: str, params: Mapping[str, Any]) -> str | None:
    """`${a.b}` from params.yaml (DVC's syntax for a dotted key), or None if it cannot."""
    def value(match: re.Match) -> str:
        node: Any = params
        for part in match.group(1).split("."):
            node = node[int(part)] if isinstance(node, list) else node[part]
        if isinstance(node, (dict, list)):
            raise TypeError("not a scalar")
        return str(node)

    try:
        return _TEMPLATE.sub(value, text)
    except (KeyError, IndexError, ValueError, TypeError):
        return None


@dataclass(frozen=True)
class ManifestStage:
    """A dvc.yaml stage that runs tasks/ingest/manifest.py: its name and arguments, `${...}` filled
    in."""

    name: str
    data: str
    out: str
    state: str | None


def manifest_stages(stages: Mapping[str, Any], params: Mapping[str, Any]) -> list[ManifestStage]:
    """The stages of dvc.yaml's `stages` whose command runs tasks/ingest/manifest.py (none in a
    pipeline of one's own that depends on its data folder directly)."""
    found = []
    for name, spec in stages.items():
        cmd = " ".join(str(spec.get("cmd", "")).split()) if isinstance(spec, Mapping) else ""
        if not cmd.startswith(manifest.COMMAND + " "):
            continue
        argv = [interpolate(arg, params) or arg for arg in shlex.split(cmd[len(manifest.COMMAND):])]
        try:
            args = manifest.parser().parse_args(argv)
        except (SystemExit, argparse.ArgumentError):
            continue
        found.append(ManifestStage(name, args.data.as_posix(), args.out.as_posix(),
                                   args.state.as_posix() if args.state else None))
    return found


def stage_deps(environ: Mapping[str, str], params: Mapping[str, Any]) -> tuple[str, list[Path]] | None:
    """(stage name, resolved dependency paths) of the DVC stage being run, or None outside DVC."""
    stage, root = environ.get("DVC_STAGE"), environ.get("DVC_ROOT")
    if not stage or not root:
        return None
    dvcfile, _, name = stage.rpartition(":")
    dvc_yaml = Path(root) / (dvcfile or "dvc.yaml")
    try:
        stages = yaml.safe_load(dvc_yaml.read_text())["stages"]
        definition = stages[name]
    except (OSError, KeyError, TypeError, yaml.YAMLError) as err:
        log.warning("cannot read stage %s from %s (%s): dependencies not checked", name, dvc_yaml, err)
        return None
    wdir = dvc_yaml.parent / str(definition.get("wdir", "."))
    # A data manifest (tasks/ingest/manifest.py) stands for the folder its stage lists.
    manifests = {(dvc_yaml.parent / str(stages[m.name].get("wdir", ".")) / m.out).resolve():
                 (dvc_yaml.parent / str(stages[m.name].get("wdir", ".")) / m.data).resolve()
                 for m in manifest_stages(stages, params)}
    paths = []
    for dep in definition.get("deps") or []:
        text = dep if isinstance(dep, str) else next(iter(dep), "")
        resolved = interpolate(str(text), params)
        if resolved is not None:
            path = (wdir / resolved).resolve()
            paths.append(manifests.get(path, path))
    return name, paths


def check_dvc_deps(
    cfg: IngestConfig, params: Mapping[str, Any], environ: Mapping[str, str] | None = None
) -> None:
    """UserError when a local source folder is not (inside) a dependency of the running stage."""
    found = stage_deps(os.environ if environ is None else environ, params)
    if found is None:
        return
    name, deps = found
    missing = []
    for i, src in enumerate(cfg.sources):
        if isinstance(src, HubSource):
            log.info(
                "ingest.sources.%d: hub dataset %s@%s is not a DVC dependency; its pinned "
                "revision in params.yaml is what reruns the stage", i, src.name, src.revision,
            )
            continue
        path = Path(src.path).resolve()
        if not any(path == dep or dep in path.parents for dep in deps):
            missing.append(src.path.as_posix())
    if missing:
        lines = "\n".join(f"      - {m}" for m in missing)
        raise UserError(
            f"ingest.sources: {', '.join(missing)} is not a dependency of the DVC stage "
            f"'{name}', so DVC would not rerun it when images there change. Add to "
            f"stages.{name}.deps in dvc.yaml:\n{lines}"
        )
