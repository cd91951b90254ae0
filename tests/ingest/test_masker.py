"""Masks made at ingest (`ingest.masker`) on the tiny CLIPSeg: size, rows, existing masks, cache."""
from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from pydantic import ValidationError

from tasks.ingest.annotate import PostPass, resolve
from tasks.ingest.annotate_config import CLIPSEG_REVISION, MaskerConfig
from tasks.ingest.masker import Masker
from tasks.ingest.tiny_annotators import build_tiny_clipseg
from tests.ingest.util import config, picture, read_jsonl, run, save

pytestmark = pytest.mark.quick  # make test-fast


@pytest.fixture(scope="module")
def clipseg(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_clipseg(tmp_path_factory.mktemp("models") / "clipseg"))


@pytest.fixture
def src(tmp_path: Path) -> Path:
    folder = tmp_path / "src"
    for i in range(3):
        save(folder / f"img{i}.png", picture(i, size=(96, 80)), caption="a toy")
    return folder


def masked(src: Path, out: Path, model: str, **kw):
    return run(config(src, output_size="short_side", masker={"model": model, "prompt": "toy", **kw}), out)


def test_generated_masks_have_the_image_size_and_are_in_the_rows(src: Path, tmp_path: Path, clipseg: str) -> None:
    r = masked(src, tmp_path / "out", clipseg, threshold=0.5, batch_size=2)
    assert len(r.kept) == 3
    for row in r.kept:
        assert row["mask_source"] == "generated"
        assert row["mask_file_name"] == f"masks/{Path(row['file_name']).stem}.png"
        with Image.open(r.out / row["mask_file_name"]) as mask, r.image(row) as image:
            assert mask.mode == "L" and mask.size == image.size == (row["width"], row["height"])
            assert set(np.unique(np.asarray(mask))) <= {0, 255}
    assert r.summary.report()["masks_by_source"]["generated"] == 3
    assert r.summary.annotations["masker"]["computed"] == 3


def test_soft_masks_and_builtin_name(src: Path, tmp_path: Path) -> None:
    r = masked(src, tmp_path / "out", "builtin:tiny-clipseg", threshold=None)
    values = set()
    for row in r.kept:
        with Image.open(r.out / row["mask_file_name"]) as mask:
            values |= set(np.unique(np.asarray(mask)).tolist())
    assert len(values - {0, 255}) > 10  # probabilities, not two levels


def test_second_run_uses_the_cache_and_a_new_threshold_runs_no_model(
    src: Path, tmp_path: Path, clipseg: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = {"cache_dir": str(tmp_path / "cache")}
    cfg = config(src, **cache, masker={"model": clipseg, "prompt": "toy", "threshold": 0.5})
    first = run(cfg, tmp_path / "a")

    def not_again(self, images):
        raise AssertionError("the masker ran although every mask was cached")

    monkeypatch.setattr(Masker, "compute", not_again)
    second = run(cfg, tmp_path / "b")
    assert second.summary.annotations["masker"]["cache_hits"] == 3
    for a, b in zip(first.kept, second.kept):
        assert (first.out / a["mask_file_name"]).read_bytes() == (second.out / b["mask_file_name"]).read_bytes()
    soft = run(config(src, **cache, masker={"model": clipseg, "prompt": "toy", "threshold": None}), tmp_path / "c")
    assert soft.summary.annotations["masker"]["cache_hits"] == 3


def test_rows_with_a_mask_are_left_untouched_and_empty_masks_are_not_written(tmp_path: Path, clipseg: str) -> None:
    out = tmp_path / "out"
    (out / "masks").mkdir(parents=True)
    rows = []
    for i in range(3):
        picture(i, size=(40, 32)).save(out / f"img{i}.png")
        rows.append({"file_name": f"img{i}.png", "text": "a toy"})
    Image.new("L", (40, 32), 255).save(out / "masks" / "mine.png")
    own = (out / "masks" / "mine.png").read_bytes()
    rows[0].update(mask_file_name="masks/mine.png", mask_source="file")
    rows[1].update(mask_file_name=None, mask_source=None)
    (out / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    model = resolve(clipseg, None, "ingest.masker.model", tmp_path)
    masker = Masker(MaskerConfig(model=clipseg, prompt="toy", threshold=None), model.folder, model.identity)
    post = PostPass([masker], None)
    post.run(out / "metadata.jsonl", out)
    after = read_jsonl(out / "metadata.jsonl")
    assert after[0] == rows[0] and (out / "masks" / "mine.png").read_bytes() == own
    assert [r["mask_source"] for r in after[1:]] == ["generated", "generated"]
    assert post.counts.by_name["masker"]["rows"] == 2
    # A mask without one subject pixel is not written: the image trains unmasked.
    row = {"file_name": "img2.png"}
    blank = io.BytesIO()
    Image.new("L", (40, 32), 0).save(blank, format="PNG")
    masker.apply(row, blank.getvalue(), out)
    assert "mask_file_name" not in row and masker.outcomes["empty"] == 1


def test_masker_config_needs_a_prompt_and_a_pinned_hub_revision(src: Path) -> None:
    with pytest.raises(ValidationError, match=r"masker.prompt\n.*Field required"):
        config(src, masker={"model": "builtin:tiny-clipseg"})
    with pytest.raises(ValidationError, match=r"masker\n.*CIDAS/clipseg-rd64-refined is a hub id: pin `revision`"):
        config(src, masker={"prompt": "toy", "revision": "main"})  # a branch moves: not a pin
    assert config(src, masker={"prompt": "toy"}).masker.revision == CLIPSEG_REVISION, "the default is pinned"
    with pytest.raises(ValidationError, match=r"masker.threshold\n"):
        config(src, masker={"model": "builtin:tiny-clipseg", "prompt": "toy", "threshold": 1.5})


def test_each_concept_gets_its_own_prompt(tmp_path: Path, clipseg: str) -> None:
    """The same picture in two rows: masked alike under one prompt, apart when their concepts' prompts differ."""
    cfg = MaskerConfig(model=clipseg, prompt="toy", prompts={"zwx ball": "ball"})
    got = resolve(cfg.model, cfg.revision, "ingest.masker.model", tmp_path)
    masker = Masker(cfg, got.folder, got.identity)
    image = picture(1, size=(96, 80))
    toy, other, ball = [{"concept": c} for c in ("sks toy", None, "zwx ball")]
    first, second, third = masker.compute([image] * 3, [toy, other, ball])
    assert first == second, "rows of concepts without an entry use `prompt`"
    assert third != first, "the concept's own prompt is the one the model reads"
    assert masker.settings(ball) != masker.settings(toy), "and it keys the cache"
