"""Source types other than plain folders: Hugging Face imagefolder and hub datasets, combined."""
from __future__ import annotations

import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tasks.common.errors import UserError
from tests.ingest.util import config, picture, run, save


def test_imagefolder_with_metadata_jsonl_at_two_depths(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    save(root / "a.png", picture(1))
    save(root / "b.png", picture(2))  # no row: caption policy (fallback)
    save(root / "sub" / "c.png", picture(3))
    save(root / "sub" / "deeper" / "d.png", picture(4))
    (root / "readme.md").write_text("hello")
    rows = [
        {"file_name": "a.png", "text": "first image"},
        {"file_name": "gone.png", "text": "missing"},
        {"file_name": "../escape.png", "text": "outside"},
        {"file_name": "a.png", "text": "listed twice"},
        {"text": "no file name"},
    ]
    lines = [json.dumps(r) for r in rows[:3]] + ["{broken json", *map(json.dumps, rows[3:])]
    (root / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    sub = [{"file_name": "c.png", "text": "third"}, {"file_name": "deeper/d.png", "text": "fourth"}]
    (root / "sub" / "metadata.jsonl").write_text("\n".join(json.dumps(r) for r in sub))
    r = run(config([{"type": "imagefolder", "path": str(root)}]), tmp_path / "out")
    texts = {row["path"]: (row["text"], row["caption_source"]) for row in r.kept}
    assert texts == {
        "a.png": ("first image", "metadata"),
        "b.png": ("a photo of sks toy", "fallback"),
        "sub/c.png": ("third", "metadata"),
        "sub/deeper/d.png": ("fourth", "metadata"),
    }
    assert r.reasons() == {
        "gone.png": "missing_image",
        "metadata.jsonl:3": "outside_root",
        "metadata.jsonl:4": "bad_metadata",
        "metadata.jsonl:5": "bad_metadata",
        "metadata.jsonl:6": "bad_metadata",
        "readme.md": "unsupported_extension",
    }
    assert r.summary.total == r.summary.kept + r.summary.rejected == 10


def test_imagefolder_with_metadata_csv_and_a_caption_column(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    save(root / "x y.png", picture(1))
    save(root / "ünï.png", picture(2))
    (root / "metadata.csv").write_text(
        'file_name,caption\n"x y.png","a caption, with a comma"\nünï.png,unicode name\n',
        encoding="utf-8",
    )
    source = {"type": "imagefolder", "path": str(root), "caption_column": "caption"}
    r = run(config([source]), tmp_path / "out")
    assert {row["path"]: row["text"] for row in r.kept} == {
        "x y.png": "a caption, with a comma", "ünï.png": "unicode name"}
    with pytest.raises(UserError, match=r"sources\.0\.caption_column: .*'text'"):
        run(config([{"type": "imagefolder", "path": str(root)}]), tmp_path / "out2")


def test_processed_output_loads_as_a_hugging_face_imagefolder(tmp_path: Path, monkeypatch) -> None:
    import datasets

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    src = tmp_path / "src"
    save(src / "a.png", picture(1), caption="first")
    save(src / "b.png", picture(2), caption="second")
    run(config(src), tmp_path / "out")
    ds = datasets.load_dataset("imagefolder", data_dir=str(tmp_path / "out"), split="train")
    assert sorted(ds["text"]) == ["first", "second"]
    assert ds[0]["image"].size == (64, 64) and ds[0]["tags"] == []


def test_hub_source_offline_is_a_clear_user_error(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    source = {"type": "hub", "name": "lambdalabs/pokemon-blip-captions", "revision": "main"}
    with pytest.raises(UserError) as err:
        run(config([source]), tmp_path / "out")
    message = str(err.value)
    assert "ingest.sources.0: could not load dataset 'lambdalabs/pokemon-blip-captions'" in message
    assert "network access" in message and "imagefolder" in message


def png_bytes(seed: int) -> bytes:
    buf = io.BytesIO()
    picture(seed).save(buf, format="PNG")
    return buf.getvalue()


def test_hub_source_reads_rows_through_datasets(tmp_path: Path, monkeypatch) -> None:
    """`datasets.load_dataset` takes a local folder by name too: the real loading code runs."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    parquet = tmp_path / "pokemon" / "data"
    parquet.mkdir(parents=True)
    struct = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    images = [{"bytes": png_bytes(i), "path": None} for i in range(3)] + [{"bytes": b"", "path": None}]
    table = pa.table({"image": pa.array(images, type=struct),
                      "text": ["a drawing of a green pokemon", None, "third", "empty"]})
    pq.write_table(table, parquet / "train-00000-of-00001.parquet")
    source = {"type": "hub", "name": str(tmp_path / "pokemon"), "revision": "main", "limit": 10}
    r = run(config([source]), tmp_path / "out")
    assert {row["path"]: row["text"] for row in r.kept} == {
        "train/0": "a drawing of a green pokemon", "train/1": "a photo of sks toy",
        "train/2": "third"}
    assert r.reasons() == {"train/3": "empty_file"}
    assert {row["caption_source"] for row in r.kept} == {"hub", "fallback"}
    limited = run(config([{**source, "limit": 1}]), tmp_path / "out2")
    assert len(limited.kept) == 1 and not limited.rejected
    with pytest.raises(UserError, match=r"sources\.0\.caption_column: .* no column 'caption'"):
        run(config([{**source, "caption_column": "caption"}]), tmp_path / "out3")


def test_hub_rows_with_a_local_path_read_only_inside_the_dataset(tmp_path: Path, monkeypatch) -> None:
    """A row that gives a path instead of bytes is read only when the path lies inside the dataset's
    folder (as local sources' files must); one pointing elsewhere is rejected, the good rows kept."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    root = tmp_path / "ds"
    inside = save(root / "images" / "a.png", picture(1))
    secret = save(tmp_path / "secret.png", picture(2))
    (root / "images" / "link.png").symlink_to(secret)
    (root / "data").mkdir()
    paths = [str(inside), "images/a.png", str(secret), "../secret.png", str(root / "images" / "link.png")]
    struct = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    table = pa.table({"image": pa.array([{"bytes": None, "path": p} for p in paths], type=struct),
                      "text": [f"row {i}" for i in range(len(paths))]})
    pq.write_table(table, root / "data" / "train-00000-of-00001.parquet")
    source = {"type": "hub", "name": str(root), "revision": "main"}
    r = run(config([source], near_duplicate_distance=None), tmp_path / "out")
    assert [row["path"] for row in r.kept] == ["train/0"]
    assert r.reasons() == {"train/1": "duplicate", "train/2": "outside_root", "train/3": "outside_root",
                           "train/4": "outside_root"}
    from tasks.ingest.checks import Reject
    from tasks.ingest.config import HubSource
    from tasks.ingest.hub import _read_local

    with pytest.raises(Reject, match="not a local dataset folder"):  # a dataset by hub id gives bytes
        _read_local(HubSource(type="hub", name="someone/remote", revision="main"), str(inside))


def test_several_sources_combine_and_deduplicate_across_sources(tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    save(one / "a.png", picture(1), caption="from one")
    save(two / "a.png", picture(1), caption="same bytes in two")
    save(two / "b.png", picture(2), caption="only in two")
    sources = [{"type": "folder", "path": str(one)}, {"type": "folder", "path": str(two)}]
    r = run(config(sources), tmp_path / "out")
    assert [(row["source"], row["path"]) for row in r.kept] == [(str(one), "a.png"), (str(two), "b.png")]
    (dup,) = r.rejected
    assert (dup["source"], dup["reason"], dup["duplicate_of"]) == (str(two), "duplicate", f"{one}/a.png")
    assert r.summary.report()["by_source"] == {str(one): {"total": 1, "kept": 1},
                                               str(two): {"total": 2, "kept": 1}}
