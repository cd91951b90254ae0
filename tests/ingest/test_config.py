"""The `ingest` params: typed sources, strict keys, errors at `ingest.sources.<i>.<key>`."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tasks.common.config import parse_section
from tasks.common.errors import UserError
from tasks.ingest.config import FolderSource, HubSource, IngestConfig, MetadataJsonSource
from tests.conftest import REPO

pytestmark = pytest.mark.quick  # make test-fast


def parse(data: dict) -> IngestConfig:
    """The section as given; without data_dir, each source names its own folder."""
    return parse_section("ingest", {"data_dir": None, **data}, IngestConfig)


def error(data: dict) -> str:
    with pytest.raises(UserError) as err:
        parse(data)
    return str(err.value)


def test_repo_params_are_the_demo_defaults() -> None:
    section = yaml.safe_load((REPO / "params.yaml").read_text())["ingest"]
    cfg = parse(section)
    assert cfg.sources == [FolderSource(type="folder", path=Path("data/demo/subject"))]
    assert cfg == IngestConfig(), "params.yaml and the model's defaults describe the same demo"


def test_every_source_type_parses() -> None:
    cfg = parse({"sources": [
        {"type": "folder", "path": "a", "caption_extensions": [".TXT"], "instance_prompt": "p"},
        {"type": "metadata_json", "path": "b", "min_score": 200, "tag_bonus_scores": {"solo": 100}},
        {"type": "imagefolder", "path": "c", "caption_column": "caption"},
        {"type": "hub", "name": "lambdalabs/pokemon-blip-captions", "revision": "abc123"},
    ]})
    folder, meta, _, hub = cfg.sources
    assert folder.caption_extensions == (".txt",)
    assert isinstance(meta, MetadataJsonSource) and meta.tag_bonus_scores == {"solo": 100}
    assert isinstance(hub, HubSource) and hub.split == "train" and hub.image_column == "image"


def test_unknown_key_in_a_source_names_its_index_and_the_keys_it_takes() -> None:
    message = error({"sources": [{"type": "folder", "path": "a"},
                                 {"type": "folder", "path": "b", "caption_ext": ".txt"}]})
    assert "ingest.sources.1.caption_ext: unknown key (misspelt?)" in message
    assert ("A 'folder' source takes: caption_extensions, concept, control_dir, instance_prompt, kohya_folders, "
            "mask_dir, path, repeats, type") in message


def test_missing_and_wrong_values_in_sources() -> None:
    assert "ingest.sources.0.revision: Field required" in error(
        {"sources": [{"type": "hub", "name": "x"}]})
    assert "ingest.sources.0.consider_every_nth: Input should be greater than or equal to 1" in error(
        {"sources": [{"type": "metadata_json", "path": "p", "consider_every_nth": 0}]})
    assert "ingest.sources.0: each source needs `type`: one of folder, metadata_json" in error(
        {"sources": [{"type": "s3", "path": "p"}]})
    assert "ingest.sources.0: each source needs `type`" in error({"sources": [{"path": "p"}]})
    assert "ingest.sources: List should have at least 1 item" in error({"sources": []})
    assert "ingest.sources.0.caption_extensions" in error(
        {"sources": [{"type": "folder", "path": "p", "caption_extensions": ["txt"]}]})


def test_training_time_options_are_refused_with_the_reason() -> None:
    message = error({"sources": [{"type": "metadata_json", "path": "p", "shuffle_tag_p": 0.5}]})
    assert "ingest.sources.0: Value error, 'shuffle_tag_p' (tag shuffling) is applied at training" in message


def test_top_level_values_are_checked() -> None:
    assert "ingest.background: Value error, each channel is 0..255" in error({"background": [0, 0, 300]})
    assert "ingest.output_size: Input should be 'square', 'short_side' or 'source'" in error(
        {"output_size": "bucket"})
    assert "ingest.captions.too_long: Input should be" in error({"captions": {"too_long": "cut"}})
    assert "ingest.source: unknown key" in error({"source": "data/demo/subject"})
    assert "ingest.resolution" in error({"resolution": 0})
    assert "ingest.max_aspect_ratio" in error({"max_aspect_ratio": 0.5})


def test_a_setting_that_would_change_nothing_is_refused() -> None:
    assert "ingest.center_crop: is set, but only output_size: square crops" in error(
        {"output_size": "short_side", "center_crop": False})
    assert "ingest.resolution: is set, but output_size: source keeps every image's own size" in error(
        {"output_size": "source", "resolution": 512})
    assert "ingest.jpeg_quality: is set, but only output_format: jpeg has a quality" in error({"jpeg_quality": 80})
    assert parse({"data_dir": "data/demo/subject", "output_size": "square", "center_crop": False,
                  "output_format": "jpeg", "jpeg_quality": 80}).jpeg_quality == 80


def test_a_source_without_path_reads_data_dir() -> None:
    cfg = parse({"data_dir": "photos", "sources": [
        {"type": "folder"}, {"type": "imagefolder", "path": "photos/more"},
        {"type": "hub", "name": "org/set", "revision": "abc123"},
    ]})
    paths = [getattr(s, "path", None) for s in cfg.sources]
    assert paths == [Path("photos"), Path("photos/more"), None]


def test_a_local_source_outside_data_dir_is_refused_with_the_fix() -> None:
    message = error({"data_dir": "photos", "sources": [{"type": "folder"},
                                                       {"type": "folder", "path": "elsewhere"}]})
    assert ("ingest.sources.1.path: lies outside ingest.data_dir (photos), the folder DVC "
            "watches") in message
    assert "'elsewhere'" in message
    assert "set data_dir to a folder that holds every local source" in message


def test_without_data_dir_every_local_source_names_its_path() -> None:
    message = error({"data_dir": None, "sources": [{"type": "metadata_json"}]})
    assert ("ingest.sources.0.path: a 'metadata_json' source needs `path`, or "
            "ingest.data_dir") in message
