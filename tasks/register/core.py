"""Log the pyfunc model into a run, register it, tag its lineage and move the aliases.

The caller chooses the run: the flow passes its parent run, so the model sits next to the
pipeline's record; `python -m tasks.register` opens a run of its own.
"""
from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import finetune_runtime
from finetune_runtime import base_reference
from finetune_runtime.adapter_cache import ADAPTER_MODELS
from finetune_runtime.convention import CONFIG_KEY
from finetune_runtime.limits import SETTINGS, serving_config, signature
from tasks.common import families
from tasks.common.config import load_config, read_params
from tasks.common.errors import UserError
from tasks.common.genai import is_runtime_export
from tasks.common.tracking import flatten, git_commit, stage_run
from tasks.register import manifest, resume
from tasks.register.base_export import BASE_SUFFIX, find_base_version, stage_adapter, stage_base
from tasks.register.config import RegisterConfig
from tasks.register.diffusers_flavor import HubBase, PyfuncWithDiffusersFlavor, fits, hub_reference
from tasks.register.lineage import (
    Evaluation,
    Lock,
    describe,
    lineage_record,
    read_evaluation,
    read_lock,
    summary_tags,
)
from tasks.register.model_contents import call_convention, model_artifacts, pip_requirements
from tasks.register.naming import Lineage, family_of_folder, model_name, of_training
from tasks.register.promotion import Champion, Decision, Goal, candidate_score, decide, other_lineage
from tasks.register.registry import (
    CHAMPION,
    LINEAGE_ARTIFACT,
    Move,
    current_champion,
    ensure_registered_model,
    move_champion,
    rescored,
)
from tasks.register.story import images, log_story, markdown, run_tags
from tasks.register.training import read_train_report, train_tags, trained_line, trained_summary

log = logging.getLogger(__name__)

CANDIDATE = "candidate"
#: The served model's code: the runtime package, logged whole (`code_paths`), and the file MLflow loads it from.
RUNTIME = Path(finetune_runtime.__file__).parent
MODEL_CODE = RUNTIME / "mlflow_model.py"
@dataclass(frozen=True)
class Registered:
    name: str
    version: str
    run_id: str
    model_uri: str
    aliases: tuple[str, ...]
    champion_moved: bool
    decision: str = ""  # why champion moved or not, as recorded on the version


def log_model(run_id: str, artifacts: dict[str, str], serving: dict[str, Any] | None,
              tags: dict[str, str], convention: dict[str, Any], name: str = "model", hub: HubBase | None = None
              ) -> Any:
    """Log the pyfunc (finetune_runtime's model with `artifacts`, the package as its code) into run
    `run_id` as `name`; with `hub`, MLflow's diffusers flavor too (diffusers_flavor.py). ModelInfo."""
    import mlflow
    from mlflow.models import Model

    log.info("logging the pyfunc model %s (artifacts %s) into run %s", name, artifacts, run_id)
    info = Model.log(
        artifact_path=None,
        name=name,
        code_paths=[str(RUNTIME)],
        flavor=PyfuncWithDiffusersFlavor(hub) if hub else mlflow.pyfunc,
        run_id=run_id,
        python_model=str(MODEL_CODE),
        artifacts=artifacts,
        signature=signature(video=bool(convention[CONFIG_KEY]["frames"])),
        pip_requirements=pip_requirements(),
        # every key logged (MLflow overrides only logged keys); the family's call convention beside the limits
        model_config={**serving_config(serving), **convention},
        metadata={"lineage": tags},
    )
    manifest.record_logged(mlflow.MlflowClient(), run_id, info)  # before any version of it exists
    return info


def create_version(client: Any, model_name: str, source: str, model_id: str | None, run_id: str,
                   tags: dict[str, str], description: str, final: bool = False) -> str:
    """The commit point of a registration: one request creates the version with its description
    and every tag, after the model files and lineage.json are stored. A server lost before it
    leaves no version; one lost after it, a complete version that no alias points to yet.
    `model_name` exists already (registry.ensure_registered_model, before any upload)."""
    # incomplete until the last write after it (resume.py); `final`: there is none
    tags = {**tags, resume.REGISTRATION_TAG: resume.COMPLETE if final else resume.INCOMPLETE}
    mv = client.create_model_version(model_name, source=source, run_id=run_id, tags=tags,
                                     description=description, model_id=model_id)
    return str(mv.version)


def base_precision(base: Path | None, trained: dict[str, Any] | None) -> dict[str, str]:
    """{component: precision} the train report says the base's denoiser and text encoders trained in
    (none left out); {} without a base or a quantized one."""
    if base is None or not trained:
        return {}
    family = families.detect(base)
    wanted = {family.denoiser.name: trained.get("base_model_precision", "none"),
              **{name: trained.get("text_encoder_precision", "none") for name in family.text.encoder_names}}
    present = families.read_index(base)
    return {name: value for name, value in wanted.items() if value not in (None, "none") and name in present}


def register_model(
    *,
    model_name: str,
    finetuned: Path,
    openvino: Path,
    lock: Lock,
    evaluation: Evaluation,
    params: dict[str, Any],
    run_id: str,
    git_commit: str | None,
    extra_tags: dict[str, Any] | None = None,
    primary_metric: str = "dino",
    primary_metric_goal: Goal = "maximize",
    base: Path | None = None,
    promote_uncalibrated: bool = False,
    champion_rescore: dict[str, Any] | None = None,
    serving: dict[str, Any] | None = None,
    hub_base: HubBase | None = None,
    trained: dict[str, Any] | None = None,
    base_copy_max_gb: float | None = None,
    lineage: Lineage | None = None,
    shown: dict[str, Path] | None = None,
) -> Registered:
    """Log the pyfunc in run `run_id`, register a version of `model_name`, tag it, set aliases.
    `trained`: the train report (tags `train.<key>`, the description); a base over `base_copy_max_gb`
    is registered by reference (base_reference.py); `lineage` (naming.py; default: `trained`'s): a
    champion of another family or task is never ranked against; `shown`: the run's images (story.py)."""
    import mlflow

    lineage = lineage or of_training(trained, family_of_folder(finetuned), flatten(lock.params).get("train.method"))
    artifacts = model_artifacts(finetuned, openvino, base)
    convention = call_convention(finetuned, base, openvino)
    if precision := base_precision(base, trained):  # what a base by reference is served in (base_reference.py)
        convention["base_precision"] = precision
    candidate_score(evaluation, primary_metric)  # a misnamed metric fails before anything is logged
    client = mlflow.MlflowClient()
    ensure_registered_model(client, model_name)  # before any upload
    steps = (trained or {}).get("steps", flatten(lock.params).get("train.max_train_steps"))
    tags, record = _what_it_is(lock, evaluation, params, git_commit, primary_metric, extra_tags, trained,
                               lineage, steps)
    tags["model.artifacts"] = "lora_adapters+base" if "base" in artifacts else "pipeline"
    unfinished = resume.find_unfinished(client, model_name, record["fingerprint"], run_id)
    if unfinished is not None:
        resume.announce(model_name, unfinished)
        if unfinished.lineage_final:
            return _only_the_tag_left(client, model_name, unfinished)
        record, run_id = unfinished.record, unfinished.run_id
        source = unfinished.source
    else:
        source, model_id = _log(client, model_name, artifacts, openvino, base, run_id, serving, convention, tags,
                                record, hub=hub_base if fits(finetuned, hub_base) else None,
                                base_copy_max_gb=base_copy_max_gb)
        log_story(client, run_id, evaluation, shown or {},  # its run shows scores, images, what trained (story.py)
                  run_tags(lineage, trained, finetuned, steps, lock.hashes.get("data/processed")), model_id)
    champion = resume.champion_to_beat(client, model_name, current_champion(client, model_name, primary_metric),
                                       unfinished, primary_metric)
    # another family's or task's champion is never re-scored or ranked against
    champion, rescore_tags = (rescored(client, model_name, champion, champion_rescore, primary_metric)
                              if not other_lineage(champion, lineage) else (champion, {}))

    def redecide(holder: Champion | None) -> Decision:
        return decide(evaluation, primary_metric, primary_metric_goal, holder, promote_uncalibrated, lineage)

    decision = redecide(champion)
    reason = decision.reason
    description = (f"{describe(lock, evaluation, git_commit, primary_metric, trained_line(trained) if trained else '')}"
                   f" Champion: {reason}.{markdown(run_id, shown or {})}")
    # a resumed registration's logged model is the cut-off run's (its artifacts, a base by reference included)
    logged = sorted(artifacts) if unfinished is None else (record.get("model") or {}).get("artifacts",
                                                                                      sorted(artifacts))
    record.update(champion=decision.tags(), model={"name": model_name, "source": source,
                                                   "run_id": run_id, "artifacts": logged})
    client.log_dict(run_id, record, LINEAGE_ARTIFACT)
    tags.update({"lineage": f"runs:/{run_id}/{LINEAGE_ARTIFACT}", "champion.decision": reason, **rescore_tags})
    if unfinished is None:
        version = create_version(client, model_name, source, model_id, run_id, tags, description)
    else:
        version = unfinished.version
        resume.retag(client, model_name, version, {"champion.decision": reason, **rescore_tags})
    return _after_the_commit(client, model_name, version, run_id, source, record, decision, redecide)


def _what_it_is(lock: Lock, evaluation: Evaluation, params: dict[str, Any], git_commit: str | None,
               primary_metric: str, extra_tags: dict[str, Any] | None, trained: dict[str, Any] | None,
               lineage: Lineage, steps: Any) -> tuple[dict[str, str], dict[str, Any]]:
    """The version's tags (lineage.py's summary, what trained, family, task, steps) and its lineage
    document (with the `lineage` section naming.py reads back and, with a train report, `train`)."""
    tags = summary_tags(lock, evaluation, git_commit, primary_metric,
                        {**train_tags(trained or {}), "family": lineage.family or "unknown",
                         "task": lineage.task or "unknown", "steps": steps, **(extra_tags or {})})
    record = lineage_record(lock, evaluation, params, git_commit, extra_tags)
    record["lineage"] = lineage.record()
    if trained:
        record["train"] = trained_summary(trained)
    return tags, record


def _after_the_commit(client: Any, model_name: str, version: str, run_id: str, source: str,
                      record: dict[str, Any], decision: Decision, redecide: Callable[[Champion | None], Decision]
                      ) -> Registered:
    """The writes after the version exists: its lineage names it, the aliases move, the lineage
    digest is recorded, and the tag says the registration is complete (resume.py)."""
    name_the_version(client, model_name, version, run_id, record)
    reason = decision.reason
    move = move_aliases(client, model_name, version, decision, redecide)
    if move.note:
        reason = _record_race(client, model_name, version, run_id, record, reason, move)
    manifest.record_lineage(client, run_id, source, LINEAGE_ARTIFACT)  # after its last write
    resume.mark_complete(client, model_name, version)
    aliases = (CANDIDATE, CHAMPION) if move.holds else (CANDIDATE,)
    log.info("registered %s version %s with aliases %s (%s)", model_name, version, aliases, reason)
    return Registered(name=model_name, version=version, run_id=run_id, model_uri=f"models:/{model_name}/{version}",
                      aliases=aliases, champion_moved=move.holds, decision=reason)


def _log(client: Any, model_name: str, artifacts: dict[str, str], openvino: Path, base: Path | None, run_id: str,
         serving: dict[str, Any] | None, convention: dict[str, Any], tags: dict[str, str],
         record: dict[str, Any], hub: HubBase | None, base_copy_max_gb: float | None) -> tuple[str, str]:
    """Log the model into `run_id` (a runtime export: its base's version first; a base over
    `base_copy_max_gb`: its reference); its source URI and id. `tags` and `record` gain what the logged model is."""
    with tempfile.TemporaryDirectory(prefix="register-") as work:
        if is_runtime_export(openvino):
            tags.update(_base_export_version(client, model_name, openvino, Path(work), base, run_id, serving,
                                             convention))
            # what the base export's endpoint reads to decide it may apply this version (adapter_cache.py)
            record["base_export"] = {k: tags[f"base_export.{k}"] for k in ("key", "model", "version")}
            artifacts["adapter"] = str(stage_adapter(openvino, Path(work), tags))
            tags["model.artifacts"] = "runtime_adapter"
        if "base" in artifacts and base_copy_max_gb is not None:
            _base_by_reference(artifacts, Path(work), base_copy_max_gb, record, tags)
        tags["model.flavors"] = "python_function,diffusers" if hub else "python_function"
        info = log_model(run_id, artifacts, serving, tags, convention, hub=hub)
    return info.model_uri, info.model_id


def _base_by_reference(artifacts: dict[str, str], work: Path, limit: float, record: dict[str, Any],
                       tags: dict[str, str]) -> None:
    """The base artifact replaced by its reference (written under `work`) when the folder is over
    `limit` GB; the lineage record gets the reference (file sizes left out), the tags say so."""
    base = Path(artifacts["base"])
    size = sum(base_reference.file_sizes(base).values())
    if size <= limit * 2 ** 30:
        return
    lock_base = (record.get("params") or {}).get("base") or {}
    reference = base_reference.write(base, work / base_reference.ARTIFACT, lock_base.get("model"),
                                     lock_base.get("revision"), (record.get("outputs") or {}).get("models/base"))
    log.info("the base %s (%.1f GB, over register.base_copy_max_gb %g) is registered by reference", base,
             size / 2 ** 30, limit)
    del artifacts["base"]
    artifacts[base_reference.ARTIFACT] = str(work / base_reference.ARTIFACT)
    record["base_reference"] = {k: v for k, v in reference.items() if k != "files"}
    tags["model.artifacts"] = "lora_adapters+base_reference"


def _only_the_tag_left(client: Any, model_name: str, unfinished: resume.Unfinished) -> Registered:
    """A cut-off registration whose every write but the last tag was done: set it."""
    resume.mark_complete(client, model_name, unfinished.version)
    decided = unfinished.record.get("champion") or {}
    moved = decided.get("champion.promoted") == "true"
    return Registered(name=model_name, version=unfinished.version, run_id=unfinished.run_id,
                      model_uri=f"models:/{model_name}/{unfinished.version}",
                      aliases=(CANDIDATE, CHAMPION) if moved else (CANDIDATE,), champion_moved=moved,
                      decision=str(decided.get("champion.decision", "")))


def _base_export_version(client: Any, model_name: str, openvino: Path, work: Path, base: Path | None,
                         run_id: str, serving: dict[str, Any] | None, convention: dict[str, Any]
                         ) -> dict[str, str]:
    """The `<model>-base` version of this runtime export's base (registered now if it is the first
    fine-tune of it); the adapter version's tags that point at it."""
    base_dir, info = stage_base(openvino, work, SETTINGS["guidance_scale"].default)
    base_name = f"{model_name}{BASE_SUFFIX}"
    version = find_base_version(client, base_name, info["key"])
    if version is None:
        ensure_registered_model(client, base_name)
        tags = {"base_export.key": info["key"], "base_export.fingerprint": info["base_fingerprint"],
                "model.artifacts": "base_export"}
        # the models whose versions its endpoint applies (finetune_runtime/adapter_cache.py): by default this one
        allowed = {ADAPTER_MODELS: list((serving or {}).get(ADAPTER_MODELS) or [model_name])}
        logged = log_model(run_id, {"openvino": str(base_dir), "finetuned": str(base)}, serving, tags,
                           {**convention, **allowed}, name="base_export")
        version = create_version(client, base_name, logged.model_uri, logged.model_id, run_id, tags,
                                 f"OpenVINO export of the base {info['base_fingerprint'][:12]} ({info['family']}); "
                                 "serves its registered fine-tunes named in the `adapter` param.", final=True)
        log.info("registered the base export as %s version %s", base_name, version)
    return {"base_export.key": info["key"], "base_export.model": base_name, "base_export.version": version}


def name_the_version(client: Any, model_name: str, version: str, run_id: str,
                     record: dict[str, Any]) -> None:
    """lineage.json names its version once the version exists (registry.read_lineage reads only
    a document that does); until then no alias has moved to it."""
    from mlflow.exceptions import MlflowException

    record["model"]["version"] = version
    try:
        client.log_dict(run_id, record, LINEAGE_ARTIFACT)
    except MlflowException as err:
        raise UserError(
            f"{model_name} version {version} is registered, but its lineage document (run {run_id}) "
            f"does not name it yet ({err}), so it has no score that promotion would read; no alias "
            "moved to it. Once the server answers, run again") from None


def _record_race(client: Any, model_name: str, version: str, run_id: str,
                 record: dict[str, Any], reason: str, move: Move) -> str:
    """Amend the decision of a version that met a concurrent registration while it moved
    `champion` (won after deciding again, or lost): tag, lineage.json; the amended reason."""
    reason = f"{reason}; {move.note}" if move.holds else f"not promoted: {move.note}"
    record["champion"].update({"champion.decision": reason, "champion.race": move.note,
                               "champion.promoted": str(move.holds).lower()})
    client.log_dict(run_id, record, LINEAGE_ARTIFACT)
    client.set_model_version_tag(model_name, version, "champion.decision", reason[:5000])
    return reason


def move_aliases(client: Any, model_name: str, version: str, decision: Decision,
                 redecide: Callable[[Champion | None], Decision]) -> Move:
    """Move `candidate` to `version`, and `champion` when promoted, read back after the move
    (tasks/register/registry.py: the race rule)."""
    from mlflow.exceptions import MlflowException

    aliases = [CANDIDATE, CHAMPION] if decision.promote else [CANDIDATE]
    try:
        client.set_registered_model_alias(model_name, CANDIDATE, version)
        if not decision.promote:
            return Move(False, decision.champion.version if decision.champion else None)
        return move_champion(client, model_name, version,
                             decision.champion.version if decision.champion else None,
                             redecide, decision.metric)
    except MlflowException as err:
        raise UserError(
            f"{model_name} version {version} is registered, complete with its tags and lineage, "
            f"but the aliases did not all move to it ({', '.join(aliases)}; {err}). They still "
            f"point to the versions they pointed to. Once the server answers, move them: "
            f"MlflowClient().set_registered_model_alias('{model_name}', '<alias>', {version}), or "
            "run again"
        ) from None


def register(
    finetuned: Path,
    openvino: Path,
    evaluation: Path,
    lock: Path = Path("dvc.lock"),
    params: Path = Path("params.yaml"),
    run_id: str | None = None,
    extra_tags: dict[str, Any] | None = None,
    base: Path | None = None,
    champion_rescore: dict[str, Any] | None = None,
    train_report: Path | None = None,
    grids: Path | None = None,
    loss_table: Path | None = None,
) -> Registered:
    """Read params, dvc.lock, the evaluation and the train stage's report (when given: what the
    version says it trained), then register: in `run_id`, or in a new run. The name is
    `register.model_name`, or follows what was trained (naming.py). `grids`: the evaluate stage's
    plots folder, `loss_table`: the train stage's loss table; the version's run shows them (story.py).

    Everything is read and checked before MLflow is touched, so a missing input fails cleanly.
    The MLflow tracking URI must already be set (`tasks.common.tracking.configure()`).
    """
    cfg = load_config("register", RegisterConfig, params)
    lock_info = read_lock(lock)
    report = read_evaluation(evaluation)
    trained = read_train_report(train_report) if train_report is not None else None
    lineage, name = resolve(cfg, lock_info, trained, Path(finetuned))
    work = tempfile.TemporaryDirectory(prefix="register-story-")
    kwargs: dict[str, Any] = dict(
        model_name=name,
        lineage=lineage,
        shown=images(grids, loss_table, Path(work.name)),
        finetuned=Path(finetuned).resolve(),
        openvino=Path(openvino).resolve(),
        lock=lock_info,
        evaluation=report,
        params={"register": read_params(params).get("register", {})},
        git_commit=git_commit(Path(params).resolve().parent),
        extra_tags=extra_tags,
        primary_metric=cfg.primary_metric,
        primary_metric_goal=cfg.primary_metric_goal,
        base=Path(base).resolve() if base is not None else None,
        promote_uncalibrated=cfg.promote_uncalibrated,
        champion_rescore=champion_rescore,
        serving={"budget_images": cfg.serve_budget_images, "max_waiting": cfg.serve_max_waiting,
                 "adapter_cache_mb": cfg.serve_adapter_cache_mb,
                 ADAPTER_MODELS: cfg.serve_adapter_models or [name]},
        hub_base=hub_reference(read_params(params).get("base") or {}),
        base_copy_max_gb=cfg.base_copy_max_gb,
        trained=trained,
    )
    with work:
        if run_id:
            return register_model(run_id=run_id, **kwargs)
        with stage_run("register", params=cfg.model_dump()) as run:
            result = register_model(run_id=run.run_id, **kwargs)
            run.set_tags({"registered_model": result.name, "registered_version": result.version})
            return result


def resolve(cfg: RegisterConfig, lock: Lock, trained: dict[str, Any] | None, finetuned: Path) -> tuple[Lineage, str]:
    """The fine-tune's lineage (the train report's family, task and method; else its folder's family
    and dvc.lock's method) and the name it registers under (naming.py)."""
    lineage = of_training(trained, family_of_folder(finetuned), flatten(lock.params).get("train.method"))
    return lineage, model_name(cfg.model_name, lineage)
