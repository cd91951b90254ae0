"""ingest.cache_dir deletes nothing the cache did not make (issue: `cache_dir: .` pruned .git).

Every case runs in a fake project under tmp_path (the working directory for the test), never
near the real `/`, home or repository.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tasks.common import safe_remove
from tasks.common.config import parse_section
from tasks.common.errors import UserError
from tasks.ingest.cache import KEEP_FINGERPRINTS, USED, close_store, open_store
from tasks.ingest.config import IngestConfig
from tests.ingest.util import picture, run_folder, save

pytestmark = pytest.mark.quick  # make test-fast


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A project with the folders a bad cache_dir once deleted; the test runs from its root."""
    root = tmp_path / "project"
    for rel in (".git/objects/ab/cdef", "data/demo/a.png", "models/base/model_index.json",
                ".cache/train/0123456789abcdef/checkpoint-2/manifest.json"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("precious")
    monkeypatch.chdir(root)
    return root


def everything(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize("value", [".", "..", "/", "./data/..", "~"])
def test_a_cache_dir_that_is_the_project_an_ancestor_root_or_home_is_refused(project: Path, value: str) -> None:
    with pytest.raises(UserError) as err:
        parse_section("ingest", {"cache_dir": value}, IngestConfig)
    message = str(err.value)
    assert "ingest.cache_dir" in message and "set it to one such as .cache/ingest" in message


def test_a_cache_dir_holding_git_tracked_files_is_refused(project: Path) -> None:
    import subprocess

    (project / ".git").rename(project / "old-git")  # a real repository instead of the fake folder
    subprocess.run(["git", "init", "-q", "."], check=True)
    subprocess.run(["git", "add", "data"], check=True)
    with pytest.raises(UserError, match=r"ingest.cache_dir: .*data holds files tracked by git"):
        parse_section("ingest", {"cache_dir": "data"}, IngestConfig)
    assert parse_section("ingest", {"cache_dir": ".cache/ingest"}, IngestConfig).cache_dir == Path(".cache/ingest")


def test_a_cache_shared_with_checkpoints_prunes_only_its_own_sets(project: Path) -> None:
    """cache_dir: .cache holds the train stage's .cache/train: pruning must leave it (and a user's
    folder that only looks like a parameter set) alone."""
    src = project / "src"
    save(src / "a.png", picture(1, (80, 72)), caption="a")
    lookalike = project / ".cache" / "fedcba9876543210"
    (lookalike / "notes").mkdir(parents=True)
    (lookalike / USED).write_text("0\n")
    before = everything(project)
    for res in (40, 44, 48, 52, 56):
        run_folder(src, project / "out" / str(res), cache_dir=".cache", resolution=res)
    sets = [d for d in (project / ".cache").iterdir() if safe_remove.is_marked(d, "ingest-cache")]
    assert len(sets) == KEEP_FINGERPRINTS
    assert before <= everything(project)  # the checkpoint, the look-alike, .git, data, models


def test_pruning_a_bad_cache_dir_that_got_past_the_config_deletes_nothing_else(project: Path) -> None:
    """Even called with the project root itself, the store prunes only the sets it made."""
    before = everything(project)
    for i in range(KEEP_FINGERPRINTS + 2):
        close_store(open_store(project, f"{i:016x}", project / "out"))
    assert before <= everything(project)
    assert sorted(d.name for d in project.iterdir() if safe_remove.is_marked(d, "ingest-cache")) == [
        f"{i:016x}" for i in range(2, KEEP_FINGERPRINTS + 2)]


def test_sets_from_before_the_marker_are_recognised_by_their_layout(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    legacy = cache / "00000000000000aa"
    (legacy / "ab").mkdir(parents=True)
    (legacy / "ab" / "abcd.json").write_text("{}")
    (legacy / USED).write_text("0\n")
    for i in range(KEEP_FINGERPRINTS):
        open_store(cache, f"{i + 1:016x}", tmp_path)
    assert not legacy.exists()  # the oldest set: pruned although unmarked
    assert len(list(cache.iterdir())) == KEEP_FINGERPRINTS


def test_a_one_run_staging_folder_is_marked_and_removed(tmp_path: Path) -> None:
    store = open_store(None, "0" * 16, tmp_path)
    assert store.root.parent == tmp_path and safe_remove.is_marked(store.root, "ingest-cache")
    close_store(store)
    assert list(tmp_path.iterdir()) == []
