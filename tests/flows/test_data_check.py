"""The flow's check before any DVC call: a folder tracked with `dvc add` (DVC hashes it itself)
must hold no FIFO, socket or device; each is named with the fix, in a second, nothing opened."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from flows.data_check import check_tracked_folders
from tasks.common.errors import UserError

pytestmark = pytest.mark.quick  # make test-fast


def test_a_fifo_in_a_dvc_tracked_folder_is_refused_naming_it_and_the_fix(tmp_path: Path) -> None:
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    raw = tmp_path / "data" / "raw"
    (raw / "sub").mkdir(parents=True)
    (raw / "a.png").write_bytes(b"png")
    (tmp_path / "data" / "raw.dvc").write_text("outs:\n- md5: 0123.dir\n  path: raw\n")
    check_tracked_folders(tmp_path)  # regular files only: nothing to say

    os.mkfifo(raw / "sub" / "evil.png")
    os.symlink("sub/evil.png", raw / "link.png")
    (tmp_path / "untracked").mkdir()
    os.mkfifo(tmp_path / "untracked" / "other.png")  # no .dvc file: DVC does not hash it
    with pytest.raises(UserError) as err:
        check_tracked_folders(tmp_path)
    assert str(err.value) == (
        "data/raw is tracked by data/raw.dvc, so DVC hashes it itself and would block for ever on:\n"
        "  data/raw/link.png: a link to a FIFO (named pipe)\n"
        "  data/raw/sub/evil.png: a FIFO (named pipe)\n"
        "For each: remove it, or replace it with the file itself (then `dvc add` the folder again). Nothing ran.")
