"""Settings a later stage refuses are refused when params.yaml loads (flows/combinations.py), naming
both keys, before any stage runs: from params.yaml itself and from a `--set` on the flow's CLI."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flows.params import apply_overrides, check_params
from tasks.common.errors import UserError
from tests.conftest import REPO

LORA = {"train.method": "lora", "export.adapters": "runtime"}
EDITS = {"ingest.data_dir": "data/demo/edits", "ingest.sources": [{"type": "folder", "control_dir": "control"}]}
REFUSED = [
    ({**LORA, "train.lora_type": "dora"},
     ["export.adapters: runtime", "train.lora_type: dora", "set train.lora_type: lora"]),
    ({**LORA, "train.lora_type": "lokr"}, ["export.adapters: runtime", "train.lora_type: lokr"]),
    ({**LORA, "train.lora_type": "loha"}, ["export.adapters: runtime", "train.lora_type: loha"]),
    ({"export.adapters": "runtime"}, ["export.adapters: runtime", "train.method: dreambooth writes a full pipeline"]),
    ({"export.adapters": "runtime", "train.method": "textual_inversion", "train.with_prior_preservation": False,
      "train.placeholder_token": "<sks>", "train.initializer_token": "toy"},
     ["export.adapters: runtime", "train.method: textual_inversion writes a text embedding"]),
    ({**LORA, "base.model": "builtin:tiny-flux"}, ["export.adapters: runtime is not available for FLUX.1",
                                                   "base.model: builtin:tiny-flux", "export.adapters: fused"]),
    ({**LORA, "base.model": "builtin:tiny-sd3", "train.train_text_encoder": True},
     ["export.adapters: runtime cannot take train.train_text_encoder: true", "text_encoder, text_encoder_2"]),
    ({**LORA, "export.inference_precision": "bf16"}, ["export.adapters: runtime", "export.inference_precision"]),
    # what the base's family refuses, known from a built-in before the base stage runs
    ({"train.method": "lora", "train.lora_format": "comfyui", "base.model": "builtin:tiny-sana"},
     ["train does not fit the base model (Sana)", "train.lora_format: comfyui", "diffusers"]),
    ({"base.model": "builtin:tiny-flux-kontext", "train.method": "lora"},
     ["export.enabled: optimum-intel has no OpenVINO pipeline for FLUX.1 Kontext", "set export.enabled: false"]),
    ({"base.model": "builtin:tiny-qwenimage-edit", "train.method": "lora", "export.enabled": False},
     ["train.with_prior_preservation: Qwen-Image-Edit makes no image from a prompt alone",
      "set train.with_prior_preservation: false"]),
    ({"base.model": "builtin:tiny-ltx", "train.method": "lora"},
     ["train.with_prior_preservation: LTX-Video trains on clips", "set train.with_prior_preservation: false"]),
    # an edit dataset: no class images beside it, a base that takes references
    ({**EDITS, "base.model": "builtin:tiny-flux2"},
     ["train.with_prior_preservation: true beside an edit dataset (ingest.sources[0].control_dir",
      "set train.with_prior_preservation: false"]),
    ({**EDITS, "train.with_prior_preservation": False},
     ["ingest.sources[0].control_dir makes an edit dataset", "Stable Diffusion", "builtin:tiny-flux2",
      "or ingest without control_dir"]),
    ({"ingest.sources": [{"type": "imagefolder", "cond_image_column": "ref"}], "base.model": "builtin:tiny-flux2"},
     ["beside an edit dataset (ingest.sources[0].cond_image_column"]),
    # clips for a video base, images for the others
    ({"base.model": "builtin:tiny-ltx", "train.with_prior_preservation": False},
     ["base.model: LTX-Video (builtin:tiny-ltx) trains on clips; ingest.sources[0] (type: folder) ingests images"]),
    ({"ingest.data_dir": "data/demo/clips", "ingest.sources": [{"type": "clips"}]},
     ["ingest.sources[0] (type: clips) ingests video clips, but Stable Diffusion", "builtin:tiny-ltx"]),
]


@pytest.fixture
def params(tmp_path: Path) -> Path:
    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    return tmp_path / "params.yaml"


@pytest.mark.parametrize(("written", "named"), REFUSED, ids=[str(sorted(w.items()))[:60] for w, _ in REFUSED])
def test_a_combination_a_later_stage_refuses_fails_at_load(params: Path, written: dict, named: list[str]) -> None:
    apply_overrides(params, written)  # in params.yaml itself, as a user would write it
    with pytest.raises(UserError) as err:
        check_params(params)
    for text in named:
        assert text in str(err.value)


def test_the_readme_edit_recipe_loads_as_written(params: Path) -> None:
    """The README's edit recipe, in params.yaml as it stands: nothing refused (mixed reference counts at
    train_batch_size 2 train in batches of one count; the instructions are the prompts)."""
    from tests.readme_blocks import recipe, settings

    written = settings(recipe("edits"))
    assert written["train.with_prior_preservation"] is False and written["base.model"] == "builtin:tiny-flux2"
    apply_overrides(params, written)
    configs = check_params(params)
    assert configs["train"].train_batch_size > 1 and configs["train"].caption_column is None


def test_the_readme_concepts_recipe_loads_as_written(params: Path) -> None:
    """docs/recipes.md's concepts recipe in params.yaml as it stands: nothing refused, each concept with its
    class prompt and weight, the loss masked (tests/e2e/test_dvc_pipeline.py runs it through `dvc repro`)."""
    import yaml

    from tests.e2e_util import merge_params
    from tests.readme_blocks import recipe

    merge_params(params, yaml.safe_load(recipe("concepts").text))  # its mappings (masker.prompts) whole
    configs = check_params(params)
    weights = {c.name: c.loss_weight for c in configs["train"].concepts}
    assert weights == {"sks toy": 1.0, "zwx ball": 0.5} and configs["train"].masked_loss
    assert configs["ingest"].sources[0].kohya_folders and configs["ingest"].captioner.mode == "missing"


def _one_line_switches() -> list[str]:
    """The built-ins docs/models.md says a user switches to by one line (`base.model`), in its order."""
    text = (REPO / "docs" / "models.md").read_text()
    start = text.index("Switching family is one line:")
    return re.findall(r"`(?:base\.model: )?(builtin:[\w-]+)`", text[start:text.index("\n\n", start)])


def test_each_family_switch_the_docs_name_is_one_line(params: Path) -> None:
    """Each family docs/models.md switches to in one line (`base.model: builtin:tiny-flux`, ...) passes the
    flow's up-front check with nothing else changed, and every text-to-image family with an OpenVINO
    export is named there (the others have their own recipe: edit models, video)."""
    from tasks.common import families

    named = _one_line_switches()
    one_line = {f.builtin for f in families.FAMILIES
                if f.export.ov_pipeline and not families.class_images_refusal(f) and f.builtin != "builtin:tiny-sd"}
    assert set(named) == one_line, (named, sorted(one_line))
    original = params.read_text()
    for builtin in named:
        params.write_text(original)
        apply_overrides(params, {"base.model": builtin})
        assert check_params(params)["base"].model == builtin


def test_the_readme_video_recipe_loads_as_written(params: Path) -> None:
    from tests.readme_blocks import recipe, settings

    apply_overrides(params, settings(recipe("video")))
    configs = check_params(params)
    assert configs["ingest"].sources[0].type == "clips" and not configs["train"].with_prior_preservation


def test_what_the_export_takes_loads(params: Path) -> None:
    assert set(check_params(params)) == {"base", "ingest", "class_images", "train", "export", "evaluate", "register"}
    apply_overrides(params, {**LORA, "train.train_text_encoder": True, "export.compression.mode": "int8"})
    assert check_params(params)["export"].adapters == "runtime"  # plain LoRA on SD 1.x, text encoder too
    apply_overrides(params, {"base.model": "builtin:tiny-sdxl"})
    check_params(params)


def test_the_flow_cli_refuses_dora_with_runtime_adapters_before_anything_runs() -> None:
    before = (REPO / "params.yaml").read_bytes()
    proc = subprocess.run([sys.executable, "-m", "flows.finetune", "--set", "train.method=lora", "--set",
                           "train.lora_type=dora", "--set", "export.adapters=runtime"], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "export.adapters: runtime cannot take train.lora_type: dora" in proc.stderr
    assert "set train.lora_type: lora, or set export.adapters: fused" in proc.stderr
    assert "Traceback" not in proc.stderr and "Running stage" not in proc.stdout + proc.stderr
    assert (REPO / "params.yaml").read_bytes() == before


EMULATED = [("train.mixed_precision", "train.mixed_precision: auto or no"),
            ("class_images.precision", "class_images.precision: auto or fp32")]


@pytest.mark.parametrize(("key", "fix"), EMULATED)
def test_an_explicit_bf16_is_refused_at_load_on_a_cpu_that_would_emulate_it(params: Path, monkeypatch, key: str,
                                                                            fix: str) -> None:
    """Flags faked both ways (finetune_runtime/cpu_formats.py): refused on an AVX2-only CPU, as the
    stage would refuse it, naming the key, the cost and the fix; loaded on one with native bf16."""
    import torch

    apply_overrides(params, {key: "bf16"})
    monkeypatch.setenv("FINETUNE_CPU_FLAGS", "avx2 avx512f avx512_bf16 amx_bf16")
    assert check_params(params)
    monkeypatch.setenv("FINETUNE_CPU_FLAGS", "avx avx2 fma")
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU computes bf16 here, so the CPU refusal is not reached: only its native half ran")
    with pytest.raises(UserError) as err:
        check_params(params)
    text = str(err.value)
    assert f"{key}: bf16 on a CPU without native bf16 (AVX2" in text and "about 500x slower" in text and fix in text
