"""Stage outputs: atomic_dir replaces only a folder a stage wrote (its marker travels with the output,
through DVC's cache too), and what it publishes reaches the disk before it takes its final name."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.common.errors import UserError
from tasks.common.outputs import OUTPUT_KIND, OUTPUT_MARKER, atomic_dir, atomic_file
from tasks.common.safe_remove import is_marked
from tests.conftest import REPO

quick = pytest.mark.quick  # make test-fast


def write(out: Path, text: str) -> None:
    with atomic_dir(out) as tmp:
        (tmp / "sub").mkdir()
        (tmp / "sub" / "weights.bin").write_text(text)


@quick
def test_an_output_carries_the_marker_and_a_rerun_replaces_it(tmp_path: Path) -> None:
    out = tmp_path / "models" / "finetuned"
    write(out, "1")
    assert is_marked(out, OUTPUT_KIND, OUTPUT_MARKER)
    write(out, "2")
    assert (out / "sub" / "weights.bin").read_text() == "2"
    assert sorted(p.name for p in out.parent.iterdir()) == ["finetuned"]  # no temporary or old folder left
    (tmp_path / "empty").mkdir()
    write(tmp_path / "empty", "3")  # an empty folder holds nothing to lose
    assert (tmp_path / "empty" / "sub" / "weights.bin").is_file()


@quick
@pytest.mark.parametrize("what", ["folder", "file", "link"])
def test_what_no_stage_wrote_is_never_replaced(tmp_path: Path, what: str) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("keep me")
    out = {"folder": theirs, "file": theirs / "notes.txt", "link": tmp_path / "link"}[what]
    if what == "link":
        out.symlink_to(theirs, target_is_directory=True)
    with pytest.raises(UserError, match=rf"refusing to replace {out}: it is a {what}.*Delete it yourself.*or "
                                        r"choose another --out"):
        write(out, "x")
    assert (theirs / "notes.txt").read_text() == "keep me" and not (theirs / OUTPUT_MARKER).exists()
    assert not list(tmp_path.rglob(".*")), "a temporary folder was left behind"


@quick
def test_an_output_written_before_the_marker_is_refused_until_deleted(tmp_path: Path) -> None:
    out = tmp_path / "reports" / "evaluate"
    write(out, "1")
    (out / OUTPUT_MARKER).unlink()  # as an output of the stage before markers looks
    with pytest.raises(UserError, match=rf"{out}: it is a folder without the {OUTPUT_MARKER} marker"):
        write(out, "2")
    (out / OUTPUT_MARKER).write_text(json.dumps({"made_by": "someone else", "kind": OUTPUT_KIND}))
    with pytest.raises(UserError, match="without the .* marker"):
        write(out, "2")
    shutil.rmtree(out)
    write(out, "2")


@quick
def test_an_output_reaches_the_disk_before_it_takes_its_name(tmp_path: Path, disk_syncs: list) -> None:
    """Files first, then their folders (the deepest first), then the rename, then the parent folder: a
    power cut never leaves the final name over data still in memory."""
    out = tmp_path / "out"
    write(out, "1")
    write(out, "2")  # replacing an earlier output too
    renames = [i for i, e in enumerate(disk_syncs) if e[0] == "replace" and e[2] == os.path.realpath(out)]
    assert len(renames) == 2
    for begin, renamed in zip([0, renames[0] + 1], renames):
        tmp = disk_syncs[renamed][1]
        synced = [e[1] for e in disk_syncs[begin:renamed] if e[0] == "fsync"]
        order = [os.path.join(tmp, "sub", "weights.bin"), os.path.join(tmp, "sub"), tmp]
        assert all(path in synced for path in order), f"not flushed before the rename: {set(order) - set(synced)}"
        assert [synced.index(path) for path in order] == sorted(synced.index(path) for path in order)
        assert os.path.join(tmp, OUTPUT_MARKER) in synced
        assert ("fsync", os.path.realpath(tmp_path)) in disk_syncs[renamed:], "the rename itself is flushed"
    disk_syncs.clear()
    with atomic_file(tmp_path / "report.json") as tmp:
        tmp.write_text("{}")
    assert [e[0] for e in disk_syncs] == ["fsync", "replace", "fsync"]


def dvc(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dvc", *args], cwd=root, check=True, capture_output=True, text=True)


def test_dvc_caches_the_marker_with_the_output_so_a_restored_output_can_be_replaced(tmp_path: Path) -> None:
    """DVC restores an output from its cache (checkout, pull); the marker, inside the output folder, comes
    back with it, so the stage may replace it again. In a plots folder (reports/evaluate) the marker's
    .json name gives DVC no plot and no error."""
    (tmp_path / "write.py").write_text(
        f"import sys\nsys.path.insert(0, {str(REPO)!r})\nfrom tasks.common.outputs import atomic_dir\n"
        "with atomic_dir(sys.argv[1]) as tmp:\n"
        "    (tmp / 'per_prompt.csv').write_text('step,clip_t\\n1,' + sys.argv[2] + '\\n')\n")
    (tmp_path / "dvc.yaml").write_text(
        f"stages:\n  evaluate:\n    cmd: {sys.executable} write.py reports/evaluate 0.5\n"
        "    plots:\n      - reports/evaluate\n")
    dvc(tmp_path, "init", "--no-scm", "-q")
    dvc(tmp_path, "repro", "-q")
    out = tmp_path / "reports" / "evaluate"
    shutil.rmtree(out)
    dvc(tmp_path, "checkout", "-q")
    assert is_marked(out, OUTPUT_KIND, OUTPUT_MARKER), "DVC restored the output without its marker"
    shown = json.loads(dvc(tmp_path, "plots", "show", "--json").stdout)
    assert "errors" not in shown and "reports/evaluate/per_prompt.csv" in shown["data"]
    subprocess.run([sys.executable, "write.py", "reports/evaluate", "0.7"], cwd=tmp_path, check=True)
    assert (out / "per_prompt.csv").read_text().endswith("1,0.7\n")
