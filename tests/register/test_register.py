"""Registration on tiny real model folders: the CLI, lineage tags, aliases, and predict in a
fresh process (the way a user or `mlflow models serve` loads the model)."""
from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
from PIL import Image

import finetune_runtime
from tasks.register import manifest
from tasks.register.core import register
from tasks.register.registry import champion_of
from tests.conftest import REPO
from tests.register.conftest import EVAL_FAIL, EVAL_PASS, TRAIN_REPORT


def _cli(project: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "tasks.register", "--finetuned", "models/finetuned",
         "--openvino", "models/openvino", "--evaluation", "reports/evaluate.json", *extra],
        cwd=project, env=env, capture_output=True, text=True, timeout=600,
    )


@pytest.fixture
def registered(project: Path) -> Path:
    """Version 1 of sd-test, registered by the CLI with a passing gate."""
    proc = _cli(project)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "registered sd-test version 1 (aliases: candidate, champion)" in proc.stderr
    return project


def test_cli_registers_version_with_lineage_and_both_aliases(registered: Path) -> None:
    client = mlflow.MlflowClient()
    mv = client.get_model_version_by_alias("sd-test", "champion")
    assert str(mv.version) == "1"
    assert str(client.get_model_version_by_alias("sd-test", "candidate").version) == "1"
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=registered, capture_output=True,
                            text=True, check=True).stdout.strip()
    # A few readable tags; the full lineage in one JSON document in the version's run.
    assert set(mv.tags) == {"base", "method", "data", "git_commit", "metric.dino", "gate",
                            "protocol", "lineage.fingerprint", "lineage", "champion.decision",
                            "model.artifacts", "model.flavors", "train.base_model_precision",
                            "train.text_encoder_precision", "train.optimizer", "train.instance_images",
                            "train.masked_loss", "registration", "family", "task", "steps"}
    assert (mv.tags["family"], mv.tags["task"], mv.tags["steps"]) == ("sd", "text-to-image", "3")
    assert mv.tags["registration"] == "complete"
    assert mv.tags["train.masked_loss"] == "off"
    assert mv.tags["git_commit"] == commit and mv.tags["method"] == "dreambooth"
    assert mv.tags["model.flavors"] == "python_function"  # a full pipeline: no diffusers flavor
    assert mv.tags["data"] == "11111111111111111111111111111111.dir"
    assert mv.tags["metric.dino"] == "0.4" and mv.tags["gate"] == "passed"
    assert mv.tags["champion.decision"].startswith("promoted")
    assert "dreambooth for 3 steps: dreambooth on a full-precision base, adamw, 3 images." in mv.description
    lineage = mlflow.artifacts.load_dict(mv.tags["lineage"])
    assert lineage["outputs"]["models/openvino"] == "33333333333333333333333333333333.dir"
    assert lineage["params"]["train"]["max_train_steps"] == 3
    assert lineage["params"]["register"]["model_name"] == "sd-test"
    assert lineage["metrics"]["clip_t"] == 0.21 and lineage["gate"]["passed"] is True
    assert lineage["champion"]["champion.promoted"] == "true"
    assert lineage["model"] == {"name": "sd-test", "version": "1", "run_id": mv.run_id,  # names its version
                                "source": mv.source, "artifacts": ["finetuned", "openvino"]}
    # The CLI logs into a run of its own, named after it.
    run = client.get_run(mv.run_id)
    assert run.info.run_name == "register" and run.info.status == "FINISHED"
    (output,) = run.outputs.model_outputs  # the pyfunc, logged from that run
    assert mv.source == f"models:/{output.model_id}"
    files = {Path(f.path).name for f in mlflow.artifacts.list_artifacts(mv.source)}
    assert {"MLmodel", "artifacts", "code", "mlflow_model.py"} <= files
    location = mlflow.get_logged_model(output.model_id).artifact_location
    code_dir = f"{location}/code/finetune_runtime"
    code = {Path(f.path).name for f in mlflow.artifacts.list_artifacts(artifact_uri=code_dir)}
    assert code == {p.name for p in Path(finetune_runtime.__file__).parent.glob("*.py")}  # the runtime, whole
    # What was registered is what loads (tasks/register/manifest.py): every stored file's SHA-256, in
    # the run, its digest a param; lineage.json's digest a param after its last write.
    registered = manifest.expected(client, mv.run_id, mv.source, "sd-test v1")
    assert {"MLmodel", "mlflow_model.py", "code/finetune_runtime/limits.py", "artifacts/openvino/model_index.json",
            "artifacts/finetuned/unet/diffusion_pytorch_model.safetensors"} <= set(registered)
    manifest.compare(registered, Path(location.removeprefix("file://")), "", "sd-test v1")  # raises on a difference
    assert champion_of(client, mv, "dino").score == 0.4  # lineage.json checked against its recorded digest
    assert manifest.LINEAGE_PARAM.format(manifest.model_key(mv.source)) in run.data.params
    # The version's own run tells the story (tasks/register/story.py): scores as metrics (linked to
    # the logged model), the grids and the loss curve as images, what trained as tags.
    assert run.data.metrics == {"clip_t": 0.21, "clip_i": 0.5, "dino": 0.4, "gate.passed": 1.0}
    assert {m.key for m in mlflow.get_logged_model(output.model_id).metrics} == set(run.data.metrics)
    shown = {Path(f.path).name: f.file_size for f in client.list_artifacts(mv.run_id, "story")}
    assert set(shown) == {"grid.png", "grid_base.png", "loss.png"} and shown["loss.png"] > 5000, shown
    with Image.open(mlflow.artifacts.download_artifacts(run_id=mv.run_id, artifact_path="story/loss.png")) as loss:
        assert loss.size == (600, 320)
    tags = run.data.tags
    assert {k: tags[k] for k in ("family", "task", "method", "adapter", "steps", "data")} == {
        "family": "sd", "task": "text-to-image", "method": "dreambooth", "adapter": "none (full weights)",
        "steps": "3", "data": "11111111111111111111111111111111.dir"}
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, env={**os.environ, "LC_ALL": "C"}).stdout
    model = next(line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name"))
    assert tags["cpu"].startswith(model), tags["cpu"]
    # its page shows the fine-tune's grid, served by the tracking server from that run
    assert f"![the fine-tune's evaluation grid](get-artifact?path=story%2Fgrid.png&run_uuid={mv.run_id})" \
        in mv.description
    assert lineage["lineage"] == {"family": "sd", "task": "text-to-image", "method": "dreambooth"}


def test_a_dora_version_says_dora_in_its_tags_and_description(project: Path) -> None:
    """What trained comes from the train stage's report (the CLI reads reports/train.json): DoRA, its
    rank and alpha, the int8 base, the optimizer, the masks and the concept, as tags and in one line."""
    report = {**TRAIN_REPORT, "method": "lora", "lora_type": "dora", "rank": 4, "lora_alpha": 4.0,
              "base_model_precision": "int8-torchao", "masked_loss": True, "masked_images": 2,
              "masked_loss_unmasked_weight": 0.0, "unmasked_probability": 0.0, "normalize_masked_area_loss": False,
              "concepts": {"sks": {"images": 3, "repeats": 1.0, "examples_per_epoch": 3, "class_images": 0,
                                   "loss_weight": 1.0, "examples_seen": 6}}}
    (project / "reports/train.json").write_text(json.dumps(report))
    proc = _cli(project)
    assert proc.returncode == 0, proc.stderr[-3000:]
    mv = mlflow.MlflowClient().get_model_version("sd-test", "1")
    assert {k: v for k, v in mv.tags.items() if k.startswith("train.")} == {
        "train.lora_type": "dora", "train.rank": "4", "train.lora_alpha": "4.0",
        "train.base_model_precision": "int8-torchao", "train.text_encoder_precision": "none",
        "train.optimizer": "adamw", "train.instance_images": "3",
        "train.masked_loss": "2 of 3 images (outside the mask weight 0, unmasked probability 0)",
        "train.concepts": "sks (3 images x1)"}
    assert ("DoRA r4 (alpha 4) on a base held in int8-torchao, adamw, 3 images (2 with masks), 1 concept: "
            "sks (3 images x1).") in mv.description
    lineage = mlflow.artifacts.load_dict(mv.tags["lineage"])
    assert lineage["train"]["lora_type"] == "dora" and lineage["train"]["masked_images"] == 2
    assert lineage["train"]["concepts"]["sks"]["images"] == 3
    (project / "reports/train.json").unlink()
    proc = _cli(project)
    assert proc.returncode == 2 and "reports/train.json not found: run the train stage first" in proc.stderr


def test_failed_gate_moves_only_candidate(registered: Path) -> None:
    (registered / "reports/evaluate.json").write_text(json.dumps(EVAL_FAIL))
    with mlflow.start_run() as run:  # as the flow does: into an existing (parent) run
        result = register(registered / "models/finetuned", registered / "models/openvino",
                          registered / "reports/evaluate.json", registered / "dvc.lock",
                          registered / "params.yaml", run_id=run.info.run_id)
    assert (result.version, result.aliases, result.champion_moved) == ("2", ("candidate",), False)
    client = mlflow.MlflowClient()
    assert str(client.get_model_version_by_alias("sd-test", "candidate").version) == "2"
    assert str(client.get_model_version_by_alias("sd-test", "champion").version) == "1"
    v2 = client.get_model_version("sd-test", "2")
    assert v2.run_id == run.info.run_id
    assert v2.tags["gate"] == "failed" and v2.tags["champion.decision"].startswith("not promoted")


def test_champion_moves_only_to_a_better_candidate(registered: Path) -> None:
    """v1 (dino 0.4) is champion; v2 passes the gate but scores lower; v3 beats v1."""
    client = mlflow.MlflowClient()

    def register_with(dino: float) -> str:
        report = {**EVAL_PASS, "metrics": {**EVAL_PASS["metrics"], "dino": dino}}
        (registered / "reports/evaluate.json").write_text(json.dumps(report))
        return register(registered / "models/finetuned", registered / "models/openvino",
                        registered / "reports/evaluate.json", registered / "dvc.lock",
                        registered / "params.yaml").version

    assert register_with(0.3) == "2"
    v2 = client.get_model_version("sd-test", "2")
    assert v2.aliases == ["candidate"]
    assert str(client.get_model_version_by_alias("sd-test", "champion").version) == "1"
    assert v2.tags["champion.decision"] == (
        "not promoted: the gate passed but it does not beat the champion "
        "(dino=0.3 vs champion v1 dino=0.4, maximize)")
    champion = mlflow.artifacts.load_dict(v2.tags["lineage"])["champion"]
    assert (champion["champion.candidate_score"], champion["champion.previous_score"]) == ("0.3", "0.4")
    assert "Champion: not promoted" in v2.description

    assert register_with(0.45) == "3"
    v3 = client.get_model_version("sd-test", "3")
    assert sorted(v3.aliases) == ["candidate", "champion"]
    champion = mlflow.artifacts.load_dict(v3.tags["lineage"])["champion"]
    assert champion["champion.previous_version"] == "1" and champion["champion.promoted"] == "true"
    assert v3.tags["champion.decision"].startswith("promoted: the gate passed and it beats")


def test_predict_in_a_fresh_process(registered: Path) -> None:
    code = (
        "import json, mlflow; "
        "m = mlflow.pyfunc.load_model('models:/sd-test@candidate'); "
        "out = m.predict(['a photo of sks toy', 'a red sks toy'], params={'num_inference_steps': 2}); "
        "print('RESULT' + json.dumps({'cols': list(out.columns), 'seeds': out['seed'].tolist(), "
        "'image': out['image'][0], 'backend': m.unwrap_python_model().backend}))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=registered.parent, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "PYTHONPATH": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert result["cols"] == ["prompt", "seed", "image"] and result["seeds"] == [0, 1]
    assert result["backend"] == "openvino"  # optimum-intel is installed here
    image = Image.open(io.BytesIO(base64.b64decode(result["image"])))
    assert image.format == "PNG" and image.size == (64, 64)


def test_diffusers_fallback_takes_a_dataframe(registered: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import pandas as pd

    monkeypatch.setenv("FINETUNE_PYFUNC_BACKEND", "diffusers")  # as if optimum-intel were absent
    model = mlflow.pyfunc.load_model("models:/sd-test@champion")
    assert model.unwrap_python_model().backend == "diffusers"
    out = model.predict(pd.DataFrame({"prompt": ["a photo of sks toy"]}),
                        params={"num_inference_steps": 2, "seed": 7})
    assert out["seed"].tolist() == [7]
    assert Image.open(io.BytesIO(base64.b64decode(out["image"][0]))).size == (64, 64)


def test_an_export_serves_dynamic_at_its_exported_size_by_default(tiny_models: Path, tmp_path: Path) -> None:
    """The pyfunc makes a request with no size at the size the export was fixed to (not the
    denoiser's sample size, which optimum-intel's dynamic load would use: 1024 px for a FLUX.2 export
    made at 256), and still makes any size asked for (an edit at its input image's size)."""
    from optimum.intel import OVStableDiffusionPipeline

    from finetune_runtime.convention import CallConvention
    from finetune_runtime.load import Loaded, openvino_pipeline
    from finetune_runtime.model import DiffusionImageModel
    from finetune_runtime.size import Shape, shape_of

    ov = OVStableDiffusionPipeline.from_pretrained(tiny_models / "openvino", compile=False, dynamic_shapes=False)
    ov.reshape(batch_size=1, height=32, width=48, num_images_per_prompt=1)
    ov.save_pretrained(tmp_path / "openvino")
    pipe, exported = openvino_pipeline(str(tmp_path / "openvino"))
    assert exported == (32, 48) and pipe.height == -1  # dynamic, the saved size remembered
    assert shape_of(pipe, CallConvention()).default == (64, 64)  # what the pipeline alone would make
    model = DiffusionImageModel()
    model.serve(Loaded(pipe, "openvino", str(tmp_path / "openvino"), exported), None)
    assert (model.budget.height, model.budget.width) == (32, 48) and model.shape == Shape((32, 48), False, 2)
    sizes = [Image.open(io.BytesIO(base64.b64decode(model.predict(None, ["a photo of sks toy"], params)["image"][0])))
             .size for params in ({"num_inference_steps": 1}, {"num_inference_steps": 1, "height": 64, "width": 64})]
    assert sizes == [(48, 32), (64, 64)]


def test_a_version_without_an_export_serves_the_pytorch_fine_tune(project: Path) -> None:
    """export.enabled: false (a model too big to convert on the machine): the stage's folder holds only
    its note; the version is registered without an openvino artifact and served by diffusers."""
    import shutil

    from tasks.common.openvino_model import write_skipped

    shutil.rmtree(project / "models/openvino")
    (project / "models/openvino").mkdir()
    write_skipped(project / "models/openvino", "export.enabled: false")
    register(project / "models/finetuned", project / "models/openvino", project / "reports/evaluate.json",
             project / "dvc.lock", project / "params.yaml")
    version = mlflow.MlflowClient().get_model_version_by_alias("sd-test", "candidate")
    assert mlflow.artifacts.load_dict(version.tags["lineage"])["model"]["artifacts"] == ["finetuned"]
    model = mlflow.pyfunc.load_model("models:/sd-test@candidate")
    assert model.unwrap_python_model().backend == "diffusers"
    out = model.predict(["a photo of sks toy"], params={"num_inference_steps": 1})
    assert Image.open(io.BytesIO(base64.b64decode(out["image"][0]))).size == (64, 64)


def test_missing_inputs_fail_before_mlflow(project: Path) -> None:
    (project / "dvc.lock").unlink()
    proc = _cli(project)
    assert proc.returncode == 2
    assert "dvc.lock not found: run the pipeline first" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert mlflow.MlflowClient().search_registered_models() == []


def test_pyfunc_reads_the_exports_runtime_settings_like_the_pipeline(tmp_path: Path) -> None:
    """The served model reads openvino_runtime.json with the runtime's reader, which reads back what the
    export stage writes, for every precision, and f32 for a folder without the file."""
    from finetune_runtime.layout import runtime_config
    from tasks.common.openvino_model import precision_config, write_runtime_config

    assert runtime_config(str(tmp_path)) == {"INFERENCE_PRECISION_HINT": "f32"}
    for precision in ("auto", "bf16", "f16", "f32"):
        write_runtime_config(tmp_path, precision)
        assert runtime_config(str(tmp_path)) == precision_config(precision), precision


def test_predict_refuses_bad_requests_before_generating(registered: Path) -> None:
    """The registered model itself (not only check_request): MLflow's typed params, then our ranges;
    a refused request never reaches the pipeline."""
    from mlflow.exceptions import MlflowException

    model = mlflow.pyfunc.load_model("models:/sd-test@candidate")
    inner = model.unwrap_python_model()
    real, calls = inner.pipe, []

    def counting(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    inner.pipe = type("Spy", (), {"__call__": staticmethod(counting), "vae_scale_factor": real.vae_scale_factor})()
    for inputs, params, error in [
        (["a"], {"num_inference_steps": -3}, r"num_inference_steps: -3 is out of range; allowed: an integer from 1"),
        (["a"], {"num_inference_steps": "x"}, r"Invalid parameters.*num_inference_steps"),  # MLflow's type check
        (["a"], {"height": 63}, r"height: 63 is out of range"),
        (["a"], {"height": 65}, rf"height: 65 is not a multiple of {real.vae_scale_factor}"),
        ([""], {}, r"inputs\[0\]: '' is not a prompt"),
        (["a"] * 5, {"num_images_per_prompt": 4}, r"20 images; at most 16"),
    ]:
        with pytest.raises(MlflowException, match=error) as info:
            model.predict(inputs, params=params)
        assert info.value.error_code == "INVALID_PARAMETER_VALUE"
    assert calls == [], "nothing was generated for a refused request"
    out = model.predict(["a", "b"], params={"num_inference_steps": 1, "num_images_per_prompt": 2, "seed": 5})
    assert out[["prompt", "seed"]].values.tolist() == [["a", 5], ["a", 6], ["b", 7], ["b", 8]]
    assert len(calls) == 4 and {c["num_inference_steps"] for c in calls} == {1}


def test_a_champion_rescored_under_the_current_protocol_is_compared_on_that_score(
        project: Path) -> None:
    """v1 was scored under protocol 'old' (dino 0.9); v2 under 'new' (dino 0.4). Compared with
    v1's old score v2 would lose; re-scored under 'new' v1 scores 0.3, and v2 wins."""
    client = mlflow.MlflowClient()

    def register_with(protocol: str, dino: float, rescore: dict | None = None):
        report = {**EVAL_PASS, "metrics": {**EVAL_PASS["metrics"], "dino": dino},
                  "protocol": {"id": protocol, "calibrated": True}}
        (project / "reports/evaluate.json").write_text(json.dumps(report))
        return register(project / "models/finetuned", project / "models/openvino",
                        project / "reports/evaluate.json", project / "dvc.lock",
                        project / "params.yaml", champion_rescore=rescore)

    assert register_with("old", 0.9).champion_moved
    without = register_with("new", 0.4)
    assert not without.champion_moved and "not comparable until the champion is re-scored" in (
        without.decision)
    # Tags claiming a re-score are display only: only a re-score done by this flow run counts.
    client.set_model_version_tag("sd-test", "1", "rescore.new", "dino=0.0")
    client.set_model_version_tag("sd-test", "1", "protocol", "new (calibrated)")
    forged = register_with("new", 0.4)
    assert not forged.champion_moved and "not comparable until the champion is re-scored" in (
        forged.decision)
    assert forged.decision.endswith("; champion v1: tag protocol=new (calibrated) disagrees with its "
                                    "lineage document (protocol old); the document is used")
    client.set_model_version_tag("sd-test", "1", "protocol", "old (calibrated)")
    rescored = {"version": "1", "report": {"metrics": {"dino": 0.3}, "protocol": {"id": "new"},
                                           "seconds_total": 12.5}}
    result = register_with("new", 0.4, rescored)
    assert result.champion_moved and result.version == "4"
    assert result.decision == ("promoted: the gate passed and it beats the champion (dino=0.4 vs "
                               "champion v1 dino=0.3, maximize) under protocol new")
    v4 = client.get_model_version("sd-test", "4")
    assert v4.tags["champion.rescored"] == (
        "v1 re-scored under protocol new: dino=0.3 (was 0.9 under old; 12.5 s)")
    assert client.get_model_version("sd-test", "1").tags["rescore.new"] == "dino=0.3"


def _register_with(project: Path, dino: float, passed: bool = True):
    report = {**EVAL_PASS, "metrics": {**EVAL_PASS["metrics"], "dino": dino},
              "gate": {**EVAL_PASS["gate"], "passed": passed}}
    (project / "reports/evaluate.json").write_text(json.dumps(report))
    return register(project / "models/finetuned", project / "models/openvino",
                    project / "reports/evaluate.json", project / "dvc.lock", project / "params.yaml")


def test_a_forged_score_tag_does_not_keep_the_champion(project: Path) -> None:
    """Whoever may tag versions sets the champion's metric.dino very high: the better candidate
    is still promoted (the score is read from the champion's lineage.json), and says why."""
    client = mlflow.MlflowClient()
    assert _register_with(project, 0.4).champion_moved
    client.set_model_version_tag("sd-test", "1", "metric.dino", "1000.0")
    result = _register_with(project, 0.45)
    assert result.champion_moved and result.aliases == ("candidate", "champion")
    assert result.decision == (
        "promoted: the gate passed and it beats the champion (dino=0.45 vs champion v1 dino=0.4, "
        "maximize); champion v1: tag metric.dino=1000.0 disagrees with its lineage document "
        "(dino=0.4); the document is used")
    v2 = client.get_model_version("sd-test", "2")
    assert v2.tags["champion.decision"] == result.decision
    champion = mlflow.artifacts.load_dict(v2.tags["lineage"])["champion"]
    assert champion["champion.previous_score"] == "0.4"
    assert champion["champion.previous_note"].startswith("tag metric.dino=1000.0 disagrees")


def test_a_registration_that_loses_the_race_for_champion_says_so(
        project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """v3 (dino 0.5) beats the champion v1 (0.4); between its move of `champion` and its
    read-back a concurrent registration moves the alias to v2 (0.6). One champion, v2; v3 keeps
    `candidate` and its record (tag, decision, lineage.json) names the version holding it."""
    client = mlflow.MlflowClient()
    assert _register_with(project, 0.4).champion_moved
    assert not _register_with(project, 0.6, passed=False).champion_moved  # v2: a better score

    class Racing(mlflow.MlflowClient):  # the real client, raced once
        def set_registered_model_alias(self, name: str, alias: str, version: str) -> None:
            super().set_registered_model_alias(name, alias, version)
            if alias == "champion" and str(version) == "3":
                super().set_registered_model_alias(name, alias, "2")

    monkeypatch.setattr(mlflow, "MlflowClient", Racing)
    result = _register_with(project, 0.5)
    assert (result.version, result.champion_moved, result.aliases) == ("3", False, ("candidate",))
    assert str(client.get_model_version_by_alias("sd-test", "champion").version) == "2"
    assert [v for v in ("1", "2", "3") if "champion" in client.get_model_version("sd-test", v).aliases] == ["2"]
    v3 = client.get_model_version("sd-test", "3")
    lost = ("v2 holds champion, moved there while this version was registered; not promoted: the "
            "gate passed but it does not beat the champion (dino=0.5 vs champion v2 dino=0.6, maximize)")
    assert v3.tags["champion.lost_race"] == lost
    assert v3.tags["champion.decision"] == result.decision == f"not promoted: lost the race for champion: {lost}"
    champion = mlflow.artifacts.load_dict(v3.tags["lineage"])["champion"]
    assert champion["champion.promoted"] == "false" and champion["champion.decision"] == result.decision


#: A Python where the project's own packages cannot be imported (a user's, with MLflow and the model's
#: libraries): it loads a registered version, predicts, and says where its runtime package came from.
ONLY_THE_RUNTIME = """
import hashlib, importlib.abc, sys


class NoProject(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("tasks", "flows", "tests", "benchmarks"):
            raise ModuleNotFoundError(f"{name}: the project is not importable here")
        return None


sys.meta_path.insert(0, NoProject())
import mlflow

model = mlflow.pyfunc.load_model(sys.argv[1])
out = model.predict(["a photo of sks toy"], params={"num_inference_steps": 1, "seed": 3})
import finetune_runtime

print("runtime", finetune_runtime.__file__)
print("images", len(out), hashlib.sha256(out["image"][0].encode()).hexdigest())
print("project", sorted(m for m in sys.modules if m.split(".")[0] in ("tasks", "flows")))
"""


def test_a_version_loads_where_only_its_runtime_is_importable(registered: Path, tmp_path: Path) -> None:
    """The served model's code is the runtime package, logged whole with the version: in a Python where
    the project cannot be imported, the version loads from the registry, predicts the image the project's
    own process predicts, and runs the version's copy of the runtime, not the checkout's."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", ONLY_THE_RUNTIME, "models:/sd-test/1"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if line.split(" ", 1)[0] in
                 ("runtime", "images", "project"))
    runtime = Path(lines["runtime"])
    assert runtime.parent.parent.name == "code" and REPO not in runtime.parents, runtime  # the version's copy
    assert lines["project"] == "[]"
    here = mlflow.pyfunc.load_model("models:/sd-test/1").predict(["a photo of sks toy"],
                                                                    params={"num_inference_steps": 1, "seed": 3})
    assert lines["images"] == f"1 {hashlib.sha256(here['image'][0].encode()).hexdigest()}"


#: The README's snippet in a fresh Python: load a registered version and predict, then write (to the file
#: argv[2]) what the process's logging, warnings and progress bars are left as.
USERS_SNIPPET = """
import json, logging, sys, warnings
import mlflow

model = mlflow.pyfunc.load_model(sys.argv[1])
model.predict(["a photo of sks toy"], params={"num_inference_steps": 1, "seed": 3})
from diffusers.utils import logging as diffusers_logging
from huggingface_hub.utils import are_progress_bars_disabled
from transformers.utils import logging as transformers_logging

from finetune_runtime.quiet import LIBRARIES

state = {"levels": {name: logging.getLogger(name).level for name in (*LIBRARIES, "", "mlflow")},
         "warnings": sorted(repr(f) for f in warnings.filters),  # those the libraries set as imported
         "bars": [diffusers_logging.is_progress_bar_enabled(), transformers_logging.is_progress_bar_enabled(),
                  are_progress_bars_disabled()]}
with open(sys.argv[2], "w") as f:
    json.dump(state, f)
"""


def _users_python(version: str, state: Path, **env: str) -> list[str]:
    """The non-empty lines (stdout and stderr, a progress bar's updates counted) of USERS_SNIPPET."""
    base = {k: v for k, v in os.environ.items() if k not in (
        "PYTHONPATH", "LOG_LEVEL", "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "HF_HUB_DISABLE_PROGRESS_BARS",
        "TRANSFORMERS_VERBOSITY", "DIFFUSERS_VERBOSITY", "FINETUNE_PYFUNC_BACKEND")}
    proc = subprocess.run([sys.executable, "-c", USERS_SNIPPET, version, str(state)], cwd=state.parent,
                          env={**base, **env}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]


def test_loading_and_predicting_a_version_prints_nothing_quiet(registered: Path, tmp_path: Path) -> None:
    """In a user's own Python (the project installed, nothing configured), loading a registered version
    and predicting prints nothing at the default level, with either backend: no library deprecations,
    fallbacks, safety-checker paragraph or progress bars (finetune_runtime/quiet.py; MLflow's download
    bars, tasks/register/verified.py). The process's logging, warning filters and bars are left as the
    libraries set them, and LOG_LEVEL=DEBUG brings the libraries' lines back."""
    states = {}
    for backend in ("openvino", "diffusers"):
        printed = _users_python("models:/sd-test@champion", tmp_path / f"{backend}.json",
                                FINETUNE_PYFUNC_BACKEND=backend)
        assert printed == [], f"{backend}: {len(printed)} lines:\n" + "\n".join(printed)
        states[backend] = json.loads((tmp_path / f"{backend}.json").read_text())
    verbose = _users_python("models:/sd-test@champion", tmp_path / "verbose.json", LOG_LEVEL="DEBUG",
                            FINETUNE_PYFUNC_BACKEND="openvino")
    assert any("safety checker" in line for line in verbose), "\n".join(verbose)  # diffusers' own paragraph
    assert any(line.startswith("Downloading artifacts") for line in verbose), "\n".join(verbose)
    # as the libraries left them where nothing quieted them
    assert states["openvino"] == json.loads((tmp_path / "verbose.json").read_text())


def test_the_flows_run_shows_the_train_stages_validation_grid(project: Path) -> None:
    """Registered into the flow's parent run: the train stage's validation grid, logged in its child
    run, is copied beside the evaluation grids (tasks/register/story.py)."""
    client = mlflow.MlflowClient()
    experiment = client.create_experiment("story")
    parent = client.create_run(experiment, run_name="finetune").info.run_id
    train = client.create_run(experiment, run_name="train", tags={"mlflow.parentRunId": parent, "stage": "train"})
    grid = Image.new("RGB", (96, 32), (10, 200, 10))
    client.log_image(train.info.run_id, grid, "validation_grid.png")
    result = register(project / "models/finetuned", project / "models/openvino", project / "reports/evaluate.json",
                      project / "dvc.lock", project / "params.yaml", run_id=parent,
                      train_report=project / "reports/train.json", grids=project / "reports/evaluate",
                      loss_table=project / "reports/train_loss.csv")
    assert client.get_model_version("sd-test", result.version).run_id == parent
    shown = {Path(f.path).name for f in client.list_artifacts(parent, "story")}
    assert shown == {"grid.png", "grid_base.png", "loss.png", "validation_grid.png"}, shown
    path = mlflow.artifacts.download_artifacts(run_id=parent, artifact_path="story/validation_grid.png")
    with Image.open(path) as copied:
        assert copied.size == (96, 32) and copied.getpixel((0, 0)) == (10, 200, 10)
    assert client.get_run(parent).data.metrics["dino"] == 0.4
