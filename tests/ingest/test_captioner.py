"""Captions made at ingest (`ingest.captioner`) on the tiny BLIP: which rows, prefix, policy, cache."""
from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from tasks.common.errors import UserError
from tasks.ingest import annotate, core
from tasks.ingest.captioner import Captioner
from tasks.ingest.tiny_annotators import build_tiny_blip
from tests.ingest.util import config, picture, run, save

pytestmark = pytest.mark.quick  # make test-fast


@pytest.fixture(scope="module")
def blip(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny BLIP saved once as a local folder (also the `local folder` way of naming a model)."""
    return str(build_tiny_blip(tmp_path_factory.mktemp("models") / "blip"))


@pytest.fixture
def src(tmp_path: Path) -> Path:
    """Two images with a caption file, two without."""
    folder = tmp_path / "src"
    save(folder / "cap1.png", picture(1), caption="a red toy")
    save(folder / "cap2.png", picture(2), caption="a blue toy")
    save(folder / "bare1.png", picture(3))
    save(folder / "bare2.png", picture(4))
    return folder


def captioned(src: Path, out: Path, **captioner):
    return run(config(src, captioner={"batch_size": 2, **captioner}), out)


def test_mode_missing_fills_only_images_without_a_caption_with_the_prefix(
    src: Path, tmp_path: Path, blip: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(annotate, "ROWS_PER_CHUNK", 3)  # metadata.jsonl read in two chunks
    r = captioned(src, tmp_path / "out", model=blip, prefix="sks toy, ")
    assert [row["path"] for row in r.kept] == ["bare1.png", "bare2.png", "cap1.png", "cap2.png"]
    rows = r.by_path()
    assert rows["cap1.png"]["text"] == "a red toy" and rows["cap1.png"]["caption_source"] == "file"
    assert rows["cap2.png"]["caption_source"] == "file"
    for name in ("bare1.png", "bare2.png"):
        assert rows[name]["caption_source"] == "captioner"
        assert rows[name]["text"].startswith("sks toy, ") and len(rows[name]["text"]) > len("sks toy, ")
        assert rows[name]["tags"] == []
    report = r.summary.report()
    assert report["captions_by_source"]["file"] == 2
    assert report["captions_by_source"]["captioner"] == 2
    assert report["captions_by_source"]["fallback"] == 0 and report["captions_from_fallback"] == 0
    assert report["annotations"]["captioner"] == {
        "rows": 2, "computed": 2, "cache_hits": 0, "captioned": 2, "empty": 0, "policy_refused": 0}


def test_mode_all_replaces_every_caption_and_builtin_names_work(src: Path, tmp_path: Path) -> None:
    r = captioned(src, tmp_path / "out", model="builtin:tiny-blip", mode="all")
    assert {row["caption_source"] for row in r.kept} == {"captioner"}
    assert r.summary.report()["captions_by_source"]["file"] == 0
    assert r.summary.report()["captions_by_source"]["captioner"] == 4


def test_generated_captions_follow_the_length_policy(src: Path, tmp_path: Path, blip: str) -> None:
    cut = run(config(src, captioner={"model": blip, "prefix": "sks toy,"},
                     captions={"max_words": 3}), tmp_path / "cut")
    for name in ("bare1.png", "bare2.png"):
        row = cut.by_path()[name]
        assert row["caption_source"] == "captioner" and row["caption_truncated"] is True
        assert len(row["text"].split()) == 3 and row["text"].startswith("sks toy,")
    dropped = run(config(src, captioner={"model": blip}, captions={"max_words": 1, "too_long": "drop",
                                                                   "fallback": "zwx"}), tmp_path / "drop")
    # A generated caption the policy refuses never drops the image: it keeps its fallback.
    assert dropped.by_path()["bare1.png"]["text"] == "zwx"
    assert dropped.by_path()["bare1.png"]["caption_source"] == "fallback"
    assert dropped.summary.report()["annotations"]["captioner"]["policy_refused"] == 2


def test_a_second_run_takes_the_captions_from_the_cache(src: Path, tmp_path: Path, blip: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = config(src, cache_dir=str(tmp_path / "cache"), captioner={"model": blip})
    first = run(cfg, tmp_path / "a")
    assert first.summary.annotations["captioner"]["computed"] == 2

    def not_again(self, images):
        raise AssertionError("the captioner ran although every caption was cached")

    monkeypatch.setattr(Captioner, "compute", not_again)
    second = run(cfg, tmp_path / "b")
    assert second.summary.annotations["captioner"]["cache_hits"] == 2
    assert second.summary.annotations["captioner"]["computed"] == 0
    assert [r["text"] for r in second.kept] == [r["text"] for r in first.kept]
    assert (tmp_path / "cache" / "annotations" / ".sd-finetune-owned").is_file()


def test_offline_hub_model_fails_before_any_image_is_processed(src: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-hf-cache"))

    def no_work(*args, **kwargs):
        raise AssertionError("images were processed before the model was resolved")

    monkeypatch.setattr(core, "run_ordered", no_work)
    rev = "0" * 40
    with pytest.raises(UserError, match=rf"ingest.captioner.model: org/captioner@{rev} is not in the local "
                                        rf"Hugging Face cache .*hf download org/captioner --revision {rev}"):
        captioned(src, tmp_path / "out", model="org/captioner", revision=rev)


def test_config_refuses_unpinned_hub_ids_and_a_captioner_that_could_never_run(src: Path) -> None:
    with pytest.raises(ValidationError, match=r"captioner\n.*revision: org/m is a hub id: pin `revision`"):
        config(src, captioner={"model": "org/m", "revision": "main"})
    with pytest.raises(ValidationError, match=r"captioner.mode\n.*captions.empty: drop drops them first"):
        config(src, captioner={}, captions={"empty": "drop"})
    with pytest.raises(ValidationError, match=r"captioner.max_new_token\n.*Extra inputs"):
        config(src, captioner={"max_new_token": 5})
    assert config(src, captioner={}).captioner.revision  # the default model comes pinned
