"""SD3, FLUX.1, FLUX.2 klein, Z-Image, Qwen-Image, Sana and FLUX.1 Kontext end to end with the real `dvc`:
`base.model: builtin:tiny-<family>` and `train.method: lora` (FLUX.1, Z-Image, Qwen-Image and Sana: DoRA on
an int8 base; SD3: exported as run-time adapters over a shared base export), then registration;
FLUX.2 klein trains on the demo's edit triples (data/demo/edits: references, target, instruction) as
the README's edit recipe writes them, edits an input image at every stage after and answers the
README's edit request at its default settings; FLUX.1 Kontext, which takes one input image, on the
triples with one reference, without an export (optimum-intel has none for it); LTX-Video on the demo
clips (data/demo/clips: `make data`'s three clips and a truncated one, which ingest rejects), exported
with OVLTXPipeline and served as an MP4.
Every output is loaded by the family's own classes (diffusers' pipeline with `load_lora_weights`,
optimum-intel's OpenVINO pipeline or OpenVINO GenAI's Text2ImagePipeline with the adapter, the
registered MLflow pyfunc by its alias: over HTTP with `mlflow models serve` for SD3's run-time
adapters and the edit models, loaded by `mlflow.pyfunc.load_model` for the others, whose served
path differs only in the family's call).
Small settings: the point is the chain, not the images.

The chain's set-up and tests, shared by the modules that run them on some of the families each
(tests/e2e/test_flow_families_*.py: `make test` runs each module whole on one worker, --dist
loadfile, so the families of different modules run on different workers): a module names its
families with `chain_fixtures` and imports the tests, which pytest collects there."""
from __future__ import annotations

import base64
import io
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml
from PIL import Image
from safetensors.torch import load_file

from tests.e2e_util import copy_repo, e2e_env
from tests.readme_blocks import recipe, settings


def nested(dotted: dict) -> dict:
    """{"train.a": 1, "ingest.video.fps": 8} -> {"train": {"a": 1}, "ingest": {"video": {"fps": 8}}} (params.yaml
    sections)."""
    out: dict = {}
    for key, value in dotted.items():
        *parents, last = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return out

SMALL = {
    "class_images": {"num_images": 2, "batch_size": 2, "num_inference_steps": 2},
    "train": {"method": "lora", "max_train_steps": 4, "train_batch_size": 1, "max_sequence_length": 32,
              "num_validation_images": 1, "validation_inference_steps": 2, "train_text_encoder": True},
    "export": {"parity": {"num_inference_steps": 2}, "latency_dynamic": False},
    "evaluate": {"images_per_prompt": 1, "num_inference_steps": 2, "max_prompts": 1},
}


#: FLUX.1 (12B), Z-Image (6B), Qwen-Image (20B) and Sana train DoRA on a quantized base (torchao int8 here),
#: as a 24 GB user of the real models would
QUANTIZED = {name: {"base_model_precision": "int8", "lora_type": "dora"}
             for name in ("flux", "zimage", "qwenimage", "sana", "ltx")}
#: SD3's LoRA is exported for OpenVINO GenAI to apply at run time (export.adapters: runtime), as a
#: team with many fine-tunes of one base would; GenAI applies SD3's transformer layers only
RUNTIME = {"sd3": {"train": {"train_text_encoder": False}, "export": {"adapters": "runtime"}}}
#: FLUX.2 klein edits: the README's edit recipe as written (the demo's (reference, target, instruction)
#: triples, references in control/, no prior preservation), at params.yaml's train_batch_size (2: the
#: one- and two-reference targets in batches of their own) and on the instructions (caption_column
#: null); FLUX.1 Kontext the three with one reference (ONE_REFERENCE), not exported, evaluated at 64 px
EDITS = {"flux2": nested(settings(recipe("edits"))),
         "kontext": {"ingest": {"data_dir": "data/demo/edits-one", "sources": [{"type": "folder",
                                                                                 "control_dir": "control"}]},
                     "train": {"with_prior_preservation": False}, "export": {"enabled": False},
                     "evaluate": {"resolution": 64}},
         #: Qwen-Image-Edit: the same triples; each input image is encoded at a megapixel (its pipeline's
         #: rule), so one triple is scored; its validation image edits the first target's reference
         "qwenimage-edit": {"ingest": {"data_dir": "data/demo/edits-one",
                                       "sources": [{"type": "folder", "control_dir": "control"}]},
                            "train": {"with_prior_preservation": False},
                            "export": {"enabled": False},
                            "evaluate": {"resolution": 64, "edits": {"max_pairs": 1}}}}
#: LTX-Video: the README's video recipe (the demo clips at 64 px, no class clips)
VIDEO = {"ltx": nested(settings(recipe("video")))}  # the README's recipe as written
#: the triples each edit family trains on, and those it is scored on
EDIT_PAIRS = {"flux2": 4, "kontext": 3, "qwenimage-edit": 3}
SCORED_PAIRS = {**EDIT_PAIRS, "qwenimage-edit": 1}
#: families that train at params.yaml's train_batch_size (2), not SMALL's 1
DEFAULT_BATCH = {"flux2"}
#: the family served the README's edit request (tests/readme_blocks.py `recipe("edits-request")`)
README_REQUEST = {"flux2"}


def small_params(root: Path, name: str) -> None:
    from tasks.common.families import by_name

    params = yaml.safe_load((root / "params.yaml").read_text())
    params["base"]["model"] = by_name(name).builtin
    with_text = bool(by_name(name).text.trainable)  # FLUX.2 klein trains no text encoder
    runtime, edits = RUNTIME.get(name, {}), EDITS.get(name, VIDEO.get(name, {}))
    small = {**SMALL, "train": {**SMALL["train"], "train_text_encoder": with_text, **QUANTIZED.get(name, {}),
                                **runtime.get("train", {}), **edits.get("train", {})},
             "export": {**SMALL["export"], **runtime.get("export", {}), **edits.get("export", {})},
             "evaluate": {**SMALL["evaluate"], **edits.get("evaluate", {})}, "ingest": edits.get("ingest", {}),
             "base": edits.get("base", {})}
    if name in DEFAULT_BATCH:
        del small["train"]["train_batch_size"]
    for section, values in small.items():
        for key, value in values.items():
            if isinstance(value, dict):
                params[section][key].update(value)
            else:
                params[section][key] = value
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


FAMILIES = ["sd3", "flux", "flux2", "zimage", "qwenimage", "sana", "kontext", "qwenimage-edit", "ltx"]
#: the module of tests/e2e/ that runs each family (test_flow_families_<part>.py), each family in one:
#: SD3 and Z-Image, the two longest chains, in different ones; the edit families together
PARTS = {"sd3_flux_sana": ["sd3", "flux", "sana"], "zimage_qwenimage": ["zimage", "qwenimage"],
         "edits": ["flux2", "kontext", "qwenimage-edit"], "video": ["ltx"]}
assert sorted(sum(PARTS.values(), [])) == sorted(FAMILIES), "every family runs in exactly one module"
#: served by `mlflow models serve` (30 s to start each); the registered versions of the others are
#: loaded and called in this process, through the same model code
SERVED_OVER_HTTP = {"sd3", "flux2", "kontext", "qwenimage-edit", "ltx"}


def one_reference(root: Path) -> None:
    """data/demo/edits-one: the demo's edit triples with one reference each (FLUX.1 Kontext takes one)."""
    import shutil

    src, dst = root / "data/demo/edits", root / "data/demo/edits-one"
    shutil.copytree(src, dst, ignore=lambda folder, names: [n for n in names if n.startswith("edit_03")])


def reproduce(root: Path, name: str) -> str | None:
    """A copy of the repo on the family's built-in tiny model: dvc repro, then registration; None, or what failed."""
    small_params(root, name)
    if name in ("kontext", "qwenimage-edit"):
        one_reference(root)
    if name in VIDEO:
        subprocess.run([sys.executable, "data/demo/clips.py", "--out", "data/demo/clips"], cwd=root, check=True,
                       capture_output=True)
    env = e2e_env(root, MLFLOW_TRACKING_URI=f"sqlite:///{root / 'mlflow.db'}")
    for cmd, timeout in ((["dvc", "repro"], 1800),
                         ([sys.executable, "-m", "tasks.register", "--finetuned", "models/finetuned",
                           "--openvino", "models/openvino", "--evaluation", "reports/evaluate.json",
                           "--base", "models/base"], 600)):
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            return f"{' '.join(cmd[:3])} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    return None


def chain_fixtures(part: str) -> tuple[Callable, Callable]:
    """The `reproduced_families` and `pipeline` fixtures of the module that runs PARTS[part]: assign
    them to those names in the module, beside the tests imported from here."""
    families = PARTS[part]

    @pytest.fixture(scope="module")
    def reproduced_families(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                            ) -> Iterator[dict[str, tuple[Path, Future]]]:
        """The module's selected families' pipelines (those whose tests were collected: `-k kontext`, or
        the node ids ending `[sana]`, run one), run side by side: each is a chain of single-threaded
        stage processes in its own copy, so two cores run them in about half the time one after another."""
        collected = {item.callspec.params.get("pipeline") for item in request.session.items
                     if item.module is request.module and hasattr(item, "callspec")}
        names = [name for name in families if name in collected]
        roots = {name: copy_repo(tmp_path_factory.mktemp(f"{name}-e2e")) for name in names}
        pool = ThreadPoolExecutor(max_workers=max(1, min(3, len(names))))  # more would only share two cores
        yield {name: (root, pool.submit(reproduce, root, name)) for name, root in roots.items()}
        pool.shutdown(wait=True)

    @pytest.fixture(scope="module", params=families)
    def pipeline(request: pytest.FixtureRequest, reproduced_families) -> tuple[str, Path]:
        root, running = reproduced_families[request.param]
        failure = running.result()
        assert failure is None, failure
        return request.param, root

    return reproduced_families, pipeline


def test_the_lora_loads_with_the_family_pipeline(pipeline) -> None:
    import torch

    from tasks.common.families import by_name

    name, root = pipeline
    cls = by_name(name).pipeline.diffusers_class()
    pipe = cls.from_pretrained(root / "models/base")
    before = {k: v.clone() for k, v in pipe.transformer.state_dict().items() if "to_q" in k}
    keys = load_file(root / "models/finetuned/pytorch_lora_weights.safetensors").keys()
    assert any("lora_magnitude_vector" in k for k in keys) == (name in QUANTIZED)  # DoRA's magnitudes
    pipe.load_lora_weights(root / "models/finetuned")
    pipe.fuse_lora()
    pipe.unload_lora_weights()
    assert any(not torch.equal(v, pipe.transformer.state_dict()[k]) for k, v in before.items())
    report = json.loads((root / "reports/train.json").read_text())
    assert report["family"] == name and report["method"] == "lora"
    assert report["base_model_precision"] == ("int8-torchao" if name in QUANTIZED else "none")
    assert (report.get("quantized_layers", 0) > 0) == (name in QUANTIZED)
    assert report.get("edit_pairs") == EDIT_PAIRS.get(name), "the demo's triples trained as edits"
    assert report["caption_column"] == ("text" if name in EDITS else None), "edits train on their instructions"
    if name in VIDEO:  # the three good demo clips trained, the truncated one rejected with its reason
        rejected = [json.loads(line) for line in (root / "reports/ingest_rejected.jsonl").read_text().splitlines()]
        assert [(r["path"], r["reason"]) for r in rejected] == [("broken.mp4", "corrupt")], rejected
        assert len((root / "data/processed/clips.jsonl").read_text().splitlines()) == 3


def test_the_export_loads_and_generates(pipeline) -> None:
    from tasks.common.families import by_name

    name, root = pipeline
    report = json.loads((root / "reports/export.json").read_text())
    if by_name(name).export.ov_pipeline is None:  # no export: the stage wrote its note, loaded nothing
        assert report["skipped"] and report["reason"] == "export.enabled: false", report
        return
    assert report["parity"]["passed"]
    if name in RUNTIME:  # base/ + the adapter, applied by GenAI: the base export is not the fine-tune
        from tasks.common.genai import adapter_config, open_runtime_export

        assert report["adapters"] == "runtime" and not (root / "models/openvino/model_index.json").exists()
        runner = open_runtime_export(root / "models/openvino", guidance_scale=7.0)
        image = runner.pipe.generate("a photo of sks toy", width=64, height=64, num_inference_steps=2,
                                     adapters=adapter_config(runner.adapters))
        assert tuple(image.shape) == (1, 64, 64, 3)
        return
    cls = by_name(name).export.ov_pipeline_class()
    assert report["pipeline_class"] == cls.__name__ == f"OV{by_name(name).pipeline.names[0]}"
    pipe = cls.from_pretrained(root / "models/openvino", dynamic_shapes=False)
    if name in VIDEO:  # a clip of the frames asked for
        frames = pipe(prompt="a photo of sks toy", num_inference_steps=2, height=64, width=64, num_frames=9).frames[0]
        assert len(frames) == 9 and frames[0].size == (64, 64)
        return
    image = pipe(prompt="a photo of sks toy", num_inference_steps=2, height=64, width=64).images[0]
    assert image.size == (64, 64)
    if name == "flux2":  # the static export takes input images of any size: their tokens stay free
        reference = Image.open(root / "data/demo/edits/control/edit_03_0.png").resize((96, 80))
        edited = pipe(prompt="make it blue", image=[reference, reference], num_inference_steps=2,
                      height=64, width=64).images[0]
        assert edited.size == (64, 64)


def _mp4_frames(encoded: str) -> int:
    """The frames of a base64 MP4, decoded with PyAV (each 64x64 RGB)."""
    import av

    with av.open(io.BytesIO(base64.b64decode(encoded))) as clip:
        frames = [f.to_ndarray(format="rgb24") for f in clip.decode(video=0)]
    assert all(f.shape == (64, 64, 3) for f in frames)
    return len(frames)


def _registered_with_its_story(family: str, root: Path, uri: str) -> str:
    """The name the flow registered under, which follows the family (tasks/register/naming.py); the
    version's run carries the evaluation's scores as metrics, its grids and the loss curve."""
    import mlflow

    from tasks.register.naming import planned

    name = planned(root / "params.yaml", root / "reports/train.json", root / "models/base")
    assert name is not None and name.startswith(f"{family}-"), name
    client = mlflow.MlflowClient(tracking_uri=uri)
    run = client.get_run(client.get_model_version_by_alias(name, "candidate").run_id)
    scores = json.loads((root / "reports/evaluate.json").read_text())["metrics"]
    numbers = {k: v for k, v in scores.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    logged = {k: run.data.metrics.get(k) for k in numbers}
    assert numbers and logged == pytest.approx(numbers, nan_ok=True), (logged, numbers)
    assert run.data.tags["family"] == family
    shown = {Path(f.path).name for f in client.list_artifacts(run.info.run_id, "story")}
    assert "loss.png" in shown and shown & {"grid.png", "grid_edits.png"}, shown
    assert ("preview.gif" in shown) == (family in VIDEO), shown  # a video model's first clip plays there
    return name


def test_mlflow_models_serve_answers(pipeline, tmp_path) -> None:
    """The registered version by its alias, a good request and a bad one: over HTTP (`mlflow models
    serve`, a process of its own) for the families in SERVED_OVER_HTTP, else loaded here by MLflow.
    SD3's run-time adapter version is served over its base export, registered as a version of its own."""
    name, root = pipeline
    evaluation = json.loads((root / "reports/evaluate.json").read_text())
    assert isinstance(evaluation["gate"]["passed"], bool)
    if name in EDITS:  # each triple's edit scored against its target and instruction, beside the base's
        pairs = SCORED_PAIRS[name]
        assert evaluation["edits"]["pairs"] == pairs and len(evaluation["edits"]["rows"]) == pairs
        assert all(f"{p}edit_{m}" in evaluation["metrics"] for p in ("", "base_", "gain_")
                   for m in ("dino", "clip_i", "clip_t"))
    env = e2e_env(root, MLFLOW_TRACKING_URI=f"sqlite:///{root / 'mlflow.db'}")
    registered = _registered_with_its_story(name, root, env["MLFLOW_TRACKING_URI"])
    good = {"inputs": ["a photo of sks toy"], "params": {"num_inference_steps": 2}}
    bad, says = {"inputs": ["a"], "params": {"num_inference_steps": -3}}, "num_inference_steps: -3 is out of range"
    if name in EDITS:  # an edit: the input image as a base64 file, every prompt of the request edits it
        reference = base64.b64encode((root / "data/demo/edits/control/edit_00.png").read_bytes()).decode()
        good = {"inputs": ["make it blue"], "params": {"num_inference_steps": 2, "image": reference}}
        bad, says = {"inputs": ["a"], "params": {"image": "bm90IGFuIGltYWdl"}}, "image[0]: not an image (a PNG"
    if name in SERVED_OVER_HTTP:
        from tests.register.http_serve import models_serve, post

        with models_serve(f"models:/{registered}@candidate", tmp_path / "serve.log", env=env, cwd=root) as (url, _):
            if name in README_REQUEST:  # the README's edit request as written: the demo's 128 px reference,
                port = url.rsplit(":", 1)[1]  # every other setting its default (20 steps)
                sent = subprocess.run(["bash", "-e", "-c", recipe("edits-request").text], cwd=root,
                                      env={**env, "PORT": port}, capture_output=True, text=True, timeout=300)
                body = json.loads(sent.stdout or "{}")  # curl -s: an HTTP 400 is a body with error_code
                status = 200 if sent.returncode == 0 and "predictions" in body else sent.returncode or 400
            else:
                status, body = post(url, good)
            if name in VIDEO:  # a playable MP4 of the convention's frames, from text or from text and a first frame
                assert status == 200 and _mp4_frames(body["predictions"][0]["video"]) == 9, body
                first = sorted((root / "data/processed/clips").glob("*/0000.png"))[0]
                status, body = post(url, {"inputs": ["a photo of sks toy"], "params": {
                    "num_inference_steps": 2, "image": base64.b64encode(first.read_bytes()).decode()}})
                assert status == 200 and _mp4_frames(body["predictions"][0]["video"]) == 9, body
            else:
                assert status == 200 and body["predictions"][0]["image"].startswith("iVBORw0K"), body
            if name in EDITS:  # the edit is at the input image's size; the same seed without it differs
                edited = Image.open(io.BytesIO(base64.b64decode(body["predictions"][0]["image"])))
                assert edited.size == Image.open(root / "data/demo/edits/control/edit_00.png").size
                status, plain = post(url, {"inputs": good["inputs"], "params": {"num_inference_steps": 2}})
                if name == "qwenimage-edit":  # it makes no image from a prompt alone
                    assert status == 400 and "image: this model edits an input image" in plain["message"], plain
                else:
                    assert status == 200 and plain["predictions"][0]["image"] != body["predictions"][0]["image"]
            status, body = post(url, bad)
            assert status == 400 and says in body["message"], body
            if name == "kontext":  # one input image, as its pipeline takes
                status, body = post(url, {"inputs": ["a"], "params": {"image": json.dumps([reference] * 2)}})
                assert status == 400 and "image: 2 input images; this model takes at most 1" in body["message"], body
    else:
        import mlflow

        mlflow.set_tracking_uri(env["MLFLOW_TRACKING_URI"])
        model = mlflow.pyfunc.load_model(f"models:/{registered}@candidate", dst_path=str(tmp_path))
        predictions = model.predict(good["inputs"], params=good["params"])  # a DataFrame in process
        assert predictions["image"][0].startswith("iVBORw0K"), predictions
        with pytest.raises(mlflow.exceptions.MlflowException, match="num_inference_steps: -3 is out of range"):
            model.predict(bad["inputs"], params=bad["params"])
    if name in RUNTIME:
        import mlflow

        client = mlflow.MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
        tags = client.get_model_version_by_alias(registered, "candidate").tags
        assert tags["model.artifacts"] == "runtime_adapter" and tags["base_export.model"] == f"{registered}-base"
