"""End to end with the real `dvc`: the whole pipeline in a copy of the repo, then nothing to redo."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import stage_runs
from tests.e2e_util import QUICK_CHECKS, copy_repo, e2e_env
from tests.readme_blocks import recipe

pytestmark = pytest.mark.e2e

#: The stages that do the work (each logs an MLflow run and is skipped when nothing changed).
STAGES = ["base", "ingest", "class_images", "train", "export", "evaluate"]
#: The data folder's manifest (tasks/ingest/manifest.py): rewritten by every `dvc repro`
#: (always_changed), the same bytes for the same folder, so ingest and all after it skip.
MANIFEST = "data_manifest"
PIPELINE = ["base", MANIFEST, *STAGES[1:]]
#: `dvc status` with nothing to redo: only the manifest, which is always rewritten.
UP_TO_DATE = {MANIFEST: ["always changed"]}


def dvc(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = e2e_env(root, MLFLOW_TRACKING_URI=f"sqlite:///{root / 'mlflow.db'}")
    return subprocess.run(["dvc", *args], cwd=root, env=env, capture_output=True, text=True, timeout=1800)


def status_json(root: Path) -> dict:
    proc = dvc(root, "status", "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout[proc.stdout.index("{"):])


def ran_stages(output: str) -> list[str]:
    return re.findall(r"Running stage '([\w-]+)'", output)


def skipped_stages(output: str) -> list[str]:
    return re.findall(r"Stage '([\w-]+)' didn't change, skipping", output)


def _concepts_recipe() -> dict[str, dict[str, Any]]:
    """docs/recipes.md's concepts recipe as written (a dataset as users bring it, data/demo/concepts.py:
    two concepts in kohya folders, four subject masks beside their images, seven images without a
    caption file; the models at ingest caption and mask the rest; class images and the loss per
    concept, the loss masked), with the offline built-in captioner and masker, as the recipe says, and
    fewer class images and a background weight, for time."""
    written = yaml.safe_load(recipe("concepts").text)
    written["ingest"]["captioner"]["model"] = "builtin:tiny-blip"
    written["ingest"]["masker"].update(model="builtin:tiny-clipseg", threshold=None)
    for concept, count in zip(written["class_images"]["concepts"], (3, 2), strict=True):
        concept["num_images"] = count
    written["train"]["masked_loss_unmasked_weight"] = 0.1
    return written


CONCEPTS = _concepts_recipe()


@pytest.fixture(scope="module")
def reproduced(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    root = copy_repo(tmp_path_factory.mktemp("dvc-e2e"), params={**CONCEPTS, **QUICK_CHECKS})
    proc = dvc(root, "repro")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return root, proc


def test_first_repro_runs_every_stage_in_order(reproduced) -> None:
    root, proc = reproduced
    assert ran_stages(proc.stdout) == PIPELINE
    assert list(yaml.safe_load((root / "dvc.yaml").read_text())["stages"]) == PIPELINE
    for out in ["models/base/model_index.json", "data/processed/metadata.jsonl",
                "models/finetuned/model_index.json", "models/openvino/model_index.json",
                "reports/ingest.json", "reports/train.json", "reports/export.json",
                "reports/evaluate.json", "reports/evaluate/grid.png"]:
        assert (root / out).is_file(), f"{out} missing after dvc repro"
    for concept in CONCEPTS["class_images"]["concepts"]:
        assert len(list((root / "data/class_images" / concept["name"]).glob("*.png"))) == concept["num_images"]
    lock = yaml.safe_load((root / "dvc.lock").read_text())
    assert set(lock["stages"]) == set(PIPELINE)


def test_every_stage_logged_a_finished_mlflow_run(reproduced) -> None:
    root, _ = reproduced
    runs = stage_runs(f"sqlite:///{root / 'mlflow.db'}")
    assert sorted(r.data.tags["stage"] for r in runs) == sorted(STAGES)
    assert {r.info.status for r in runs} == {"FINISHED"}
    train = next(r for r in runs if r.data.tags["stage"] == "train")
    assert "loss" in train.data.metrics


def test_outputs_load_in_diffusers_and_optimum_intel(reproduced) -> None:
    from diffusers import DiffusionPipeline
    from optimum.intel import OVStableDiffusionPipeline

    root, _ = reproduced
    assert type(DiffusionPipeline.from_pretrained(root / "models/finetuned")).__name__ == "StableDiffusionPipeline"
    ov = OVStableDiffusionPipeline.from_pretrained(root / "models/openvino", compile=False)
    assert ov.unet is not None
    report = json.loads((root / "reports/evaluate.json").read_text())
    assert isinstance(report["gate"]["passed"], bool)


def test_second_repro_skips_every_stage(reproduced) -> None:
    root, _ = reproduced
    start = time.monotonic()
    proc = dvc(root, "repro")
    seconds = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr
    assert ran_stages(proc.stdout) == [MANIFEST]
    assert sorted(skipped_stages(proc.stdout)) == sorted(STAGES)
    assert status_json(root) == UP_TO_DATE
    print(f"second dvc repro: {seconds:.1f} s")


def test_a_launcher_change_touches_only_the_stages_that_launch(reproduced) -> None:
    """dvc.yaml's code deps come from the import graph (tasks/common/stage_deps.py): a change to
    tasks/common/launch.py is a changed dependency of class_images and train, of no other stage."""
    root, _ = reproduced
    launch = root / "tasks/common/launch.py"
    text = launch.read_text()
    launch.write_text(text + "# a comment: the module changed, nothing it does\n")
    try:
        status = dvc(root, "status", "--json")
        shown = dvc(root, "status").stdout
    finally:
        launch.write_text(text)
    assert status.returncode == 0, status.stderr
    print(f"dvc status after the change:\n{shown}")
    changed = json.loads(status.stdout)
    code = {stage: sorted(path for entry in entries if isinstance(entry, dict)
                          for path in entry.get("changed deps", {}) if path.startswith("tasks/"))
            for stage, entries in changed.items()}
    assert {stage for stage, paths in code.items() if paths} == {"class_images", "train"}, changed
    assert code["class_images"] == code["train"] == ["tasks/common/launch.py"], changed
    assert set(changed) == {"class_images", "train", MANIFEST}, f"no other stage is changed at all: {changed}"
    assert shown.count("modified:") == 2 and "tasks/common/launch.py" in shown, shown
    assert status_json(root) == UP_TO_DATE, "back as it was"


def test_a_param_change_reruns_only_the_stages_that_read_it(reproduced) -> None:
    root, _ = reproduced
    params = root / "params.yaml"
    text = params.read_text()
    new = re.sub(r"(\n  images_per_prompt: )(\d+)", lambda m: f"{m.group(1)}{int(m.group(2)) + 1}", text, count=1)
    assert new != text, "evaluate.images_per_prompt not found in params.yaml"
    params.write_text(new)
    proc = dvc(root, "repro")
    assert proc.returncode == 0, proc.stderr
    assert ran_stages(proc.stdout) == [MANIFEST, "evaluate"]
    assert sorted(skipped_stages(proc.stdout)) == sorted(STAGES[:-1])


def _typo(text: str, key: str) -> str:
    """params.yaml's text with the first two-space-indented `key:` misspelt by its last letter."""
    new = re.sub(rf"\n  {key}:", f"\n  {key[:-1]}:", text, count=1)
    assert new != text, f"{key} not found in params.yaml"
    return new


def test_a_misspelt_key_costs_no_output(reproduced) -> None:
    """A typo in train's section: `dvc repro` fails in one line with the closest key, and
    models/finetuned and train's reports are as they were (persist: true in dvc.yaml). A typo in
    evaluate's section: DVC removed evaluate's reports first; the error names `dvc checkout
    evaluate`, which brings them back."""
    root, _ = reproduced
    params = root / "params.yaml"
    text = params.read_text()
    kept = ["reports/train.json", "reports/train_loss.csv",
            *(str(p.relative_to(root)) for p in sorted((root / "models/finetuned").rglob("*")) if p.is_file())]
    before = {path: (root / path).read_bytes() for path in kept}
    try:
        params.write_text(_typo(text, "learning_rate"))
        start = time.monotonic()
        proc = dvc(root, "repro")
        print(f"dvc repro with a misspelt train key: {time.monotonic() - start:.1f} s")
        shown = proc.stdout + proc.stderr
        assert proc.returncode != 0 and ran_stages(proc.stdout) == [MANIFEST, "train"], shown[-3000:]
        line = ("error: params.yaml: invalid parameters: train.learning_rat: unknown key (misspelt?). "
                "Did you mean 'train.learning_rate'? Every key of 'train': docs/parameters.md\n")
        assert line in shown, shown[-3000:]
        assert "dvc checkout" not in shown, "nothing was removed, nothing to bring back"
        assert {path: (root / path).read_bytes() for path in kept} == before

        params.write_text(_typo(text, "images_per_prompt"))
        proc = dvc(root, "repro")
        shown = proc.stdout + proc.stderr
        assert proc.returncode != 0 and ran_stages(proc.stdout) == [MANIFEST, "evaluate"], shown[-3000:]
        assert "Did you mean 'evaluate.images_per_prompt'?" in shown, shown[-3000:]
        assert "`dvc checkout evaluate` brings them back" in shown, shown[-3000:]
        assert not (root / "reports/evaluate.json").exists()
    finally:
        params.write_text(text)
    assert dvc(root, "checkout", "evaluate").returncode == 0
    assert (root / "reports/evaluate.json").is_file() and (root / "reports/evaluate/grid.png").is_file()
    assert status_json(root) == UP_TO_DATE


def test_masks_captions_and_concepts_reach_the_registered_model(reproduced) -> None:
    """Every image is kept with its concept and a mask (its own or a made one) and a caption (its
    file, the captioner's); the train report counts examples per concept; the model registers
    (last in this module: registering adds a run the tests above do not expect)."""
    root, _ = reproduced
    rows = [json.loads(line) for line in (root / "data/processed/metadata.jsonl").read_text().splitlines()]
    assert sorted(r["concept"] for r in rows) == ["sks toy"] * 6 + ["zwx ball"] * 4
    assert sorted(r["mask_source"] for r in rows) == ["generated"] * 6 + ["masklabel"] * 4
    assert all((root / "data/processed" / r["mask_file_name"]).is_file() for r in rows)
    by_caption = {s: sum(r["caption_source"] == s for r in rows) for s in {r["caption_source"] for r in rows}}
    assert by_caption == {"file": 3, "captioner": 7}, by_caption
    ingest = json.loads((root / "reports/ingest.json").read_text())
    assert ingest["masks_by_source"] == {"file": 0, "masklabel": 4, "alpha": 0, "generated": 6}
    train = json.loads((root / "reports/train.json").read_text())
    assert set(train["concepts"]) == {"sks toy", "zwx ball"}, train.get("concepts")
    env = e2e_env(root, MLFLOW_TRACKING_URI=f"sqlite:///{root / 'mlflow.db'}")
    done = subprocess.run([sys.executable, "-m", "tasks.register", "--finetuned", "models/finetuned",
                           "--openvino", "models/openvino", "--evaluation", "reports/evaluate.json"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    from mlflow.tracking import MlflowClient

    versions = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"]).search_model_versions()
    assert [str(v.version) for v in versions] == ["1"], "one version, registered from this repro"
