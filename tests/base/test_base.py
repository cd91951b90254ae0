"""Stage `base`: built-in tiny models, local folders, pinned hub downloads and their errors."""
from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.base.core import classify, resolve
from tasks.common.errors import UserError
from tasks.common.families import from_index
from tests.conftest import stage_runs


def tree_hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


CLIP_WORDS = ["a</w>", "photo</w>", "of</w>", "sks</w>", "toy</w>"]  # the locally learned CLIP BPE
QWEN_WORDS = ["a", "Ġphoto", "Ġof", "Ġsks", "Ġtoy"]  # byte-level BPE: a word's leading space is 'Ġ'
GEMMA_WORDS = ["a", "▁photo", "▁of", "▁sks", "▁toy"]  # SentencePiece BPE: a word's leading space is '▁'


@pytest.mark.parametrize("kind,fam,cls,words", [
    ("builtin:tiny-sd", "sd", "StableDiffusionPipeline", CLIP_WORDS),
    ("builtin:tiny-sdxl", "sdxl", "StableDiffusionXLPipeline", CLIP_WORDS),
    ("builtin:tiny-sd3", "sd3", "StableDiffusion3Pipeline", CLIP_WORDS),
    ("builtin:tiny-flux", "flux", "FluxPipeline", CLIP_WORDS),
    ("builtin:tiny-flux2", "flux2", "Flux2KleinPipeline", QWEN_WORDS),
    ("builtin:tiny-zimage", "zimage", "ZImagePipeline", QWEN_WORDS),
    ("builtin:tiny-qwenimage", "qwenimage", "QwenImagePipeline", QWEN_WORDS),
    ("builtin:tiny-sana", "sana", "SanaPipeline", GEMMA_WORDS),
])
def test_builtin_is_deterministic_and_loads(tmp_path: Path, kind: str, fam: str, cls: str, words: list[str]) -> None:
    from diffusers import DiffusionPipeline

    info = resolve(kind, None, 0, tmp_path / "a")
    resolve(kind, None, 0, tmp_path / "b")
    resolve(kind, None, 1, tmp_path / "c")
    assert info["family"] == fam and info["pipeline_class"] == cls
    a, b, c = (tree_hashes(tmp_path / n) for n in "abc")
    assert a == b, "same seed must give byte-identical files (DVC hashes them)"
    assert a != c, "another seed must give other weights"
    assert any(name.endswith(".safetensors") for name in a)
    pipe = DiffusionPipeline.from_pretrained(tmp_path / "a")
    assert type(pipe).__name__ == cls
    ids = pipe.tokenizer("a photo of sks toy", add_special_tokens=False).input_ids
    assert pipe.tokenizer.convert_ids_to_tokens(ids) == words


def test_local_folder_is_copied(tmp_path: Path) -> None:
    resolve("builtin:tiny-sd", None, 0, tmp_path / "src")
    info = resolve(str(tmp_path / "src"), None, 0, tmp_path / "dst")
    assert info["source"] == "local" and info["family"] == "sd"
    assert tree_hashes(tmp_path / "src") == tree_hashes(tmp_path / "dst")


def test_local_folder_that_is_not_a_pipeline(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    with pytest.raises(UserError, match="model_index.json"):
        resolve(str(tmp_path / "src"), None, 0, tmp_path / "dst")


def test_classify() -> None:
    assert classify("builtin:tiny-sd") == "builtin"
    assert classify("stable-diffusion-v1-5/stable-diffusion-v1-5") == "hub"
    with pytest.raises(UserError, match="unknown built-in"):
        classify("builtin:tiny-sd4")
    with pytest.raises(UserError, match="neither"):
        classify("not a model id")


def test_hub_needs_a_pinned_revision(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="pin a commit"):
        resolve("stable-diffusion-v1-5/stable-diffusion-v1-5", None, 0, tmp_path / "dst")


def test_hub_offline_says_so_and_how_to_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)  # read once, at import
    with pytest.raises(UserError) as err:
        resolve("stable-diffusion-v1-5/stable-diffusion-v1-5", "451f4fe16113bff5a5d2269ed5ad43b0592e9a14",
                0, tmp_path / "dst")
    assert "offline" in str(err.value) and "base.model: DIR" in str(err.value)


def test_hub_out_of_reach_says_so_and_how_to_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not in offline mode, but no hub answers (a closed loopback port): the same advice, no traceback."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "2")
    with pytest.raises(UserError) as err:
        resolve("stable-diffusion-v1-5/stable-diffusion-v1-5", "451f4fe16113bff5a5d2269ed5ad43b0592e9a14",
                0, tmp_path / "dst")
    assert "offline" in str(err.value) and "base.model: DIR" in str(err.value)


def test_family_detection() -> None:
    assert from_index({"_class_name": "StableDiffusionXLPipeline", "text_encoder_2": []}).name == "sdxl"
    assert from_index({"_class_name": "StableDiffusionPipeline"}).name == "sd"


def run_stage(cwd: Path, params: str) -> subprocess.CompletedProcess[str]:
    (cwd / "params.yaml").write_text(params)
    return subprocess.run([sys.executable, "-m", "tasks.base", "--out", "models/base"], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def test_cli_writes_the_model_and_logs_a_run(tmp_path: Path, isolated_mlflow: str) -> None:
    proc = run_stage(tmp_path, "base:\n  model: builtin:tiny-sd\n  seed: 0\n")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "models/base/model_index.json").is_file()
    runs = stage_runs(isolated_mlflow)
    assert [r.data.tags["stage"] for r in runs] == ["base"]
    assert runs[0].data.tags["base.family"] == "sd" and runs[0].info.status == "FINISHED"


def test_cli_bad_params_fail_cleanly_and_write_nothing(tmp_path: Path) -> None:
    proc = run_stage(tmp_path, "base:\n  modle: builtin:tiny-sd\n  seed: -1\n")
    assert proc.returncode == 2
    assert "base.modle: unknown key" in proc.stderr and "base.seed" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "models").exists()


def test_cli_offline_hub_leaves_no_half_written_output(tmp_path: Path) -> None:
    proc = run_stage(tmp_path, "base:\n  model: org/model\n  revision: '" + "0" * 40 + "'\n")
    assert proc.returncode == 2 and "could not download org/model" in proc.stderr
    assert not (tmp_path / "models/base").exists()
    assert not any((tmp_path / "models").iterdir()), "the temporary folder must be cleaned up"
