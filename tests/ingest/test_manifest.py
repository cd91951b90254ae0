"""The data manifest DVC versions instead of the data folder: special files are never opened, the
same folder gives the same bytes, any change to the folder changes them."""
from __future__ import annotations

import hashlib
import os
import socket
import threading
from pathlib import Path

import pytest
import yaml

from flows.changes import manifest_changes, unwatched_sources
from tasks.ingest import manifest
from tasks.ingest.deps import manifest_stages
from tests.conftest import REPO

pytestmark = pytest.mark.quick  # make test-fast


def folder(tmp_path: Path) -> Path:
    root = tmp_path / "data"
    (root / "sub").mkdir(parents=True)
    (root / "a.png").write_bytes(b"\x89PNG one")
    (root / "a.txt").write_text("a photo of sks toy")
    (root / "sub" / "b.png").write_bytes(b"\x89PNG two")
    return root


def bounded_build(root: Path, **kwargs) -> dict:
    """`manifest.build` in a thread that must end within 20 s (a FIFO opened would block it)."""
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(manifest.build(root, **kwargs)), daemon=True)
    worker.start()
    worker.join(20)
    assert not worker.is_alive(), "building the manifest blocked"
    return result


def test_fifos_sockets_devices_and_links_to_them_are_listed_never_opened(tmp_path: Path) -> None:
    root = folder(tmp_path)
    os.mkfifo(root / "evil.png")
    os.symlink("../evil.png", root / "sub" / "link_to_fifo.png")
    os.symlink("/dev/zero", root / "zero.png")  # read, it would never end
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(root / "sock.png"))
        warnings: list[str] = []
        entries = bounded_build(root, warn=warnings.append)["entries"]
    assert entries["evil.png"] == {"special": "fifo"}
    assert entries["sock.png"] == {"special": "socket"}
    assert entries["sub/link_to_fifo.png"] == {"link": "../evil.png"}
    assert entries["zero.png"] == {"link": "/dev/zero"}
    assert entries["a.png"] == {"size": 8, "sha256": hashlib.sha256(b"\x89PNG one").hexdigest()}
    said = "\n".join(warnings)
    assert f"{root / 'evil.png'}: a FIFO (named pipe), not a regular file: never opened, ingest rejects it " \
           "(not_regular_file); remove it, or replace it with the file itself" in said
    assert f"{root / 'zero.png'}: a link to a character device" in said
    assert f"{root / 'sub' / 'link_to_fifo.png'}: a link to a FIFO" in said
    assert f"{root / 'sock.png'}: a socket" in said


def test_the_same_folder_gives_the_same_bytes_and_every_change_changes_them(tmp_path: Path) -> None:
    root = folder(tmp_path)
    first = manifest.dumps(manifest.build(root))
    os.utime(root / "a.png", (1, 1))  # touched, same content: nothing for ingest to redo
    assert manifest.dumps(manifest.build(root)) == first
    changes = [lambda: (root / "a.png").write_bytes(b"\x89PNG edited"),   # an edited image
               lambda: (root / "sub" / "c.png").write_bytes(b"new"),      # a new one
               lambda: (root / "a.txt").unlink(),                         # a removed caption
               lambda: (root / "sub" / "b.png").rename(root / "b.png"),   # a moved image
               lambda: os.mkfifo(root / "late.png")]                      # a FIFO appearing
    seen = {first}
    for change in changes:
        change()
        now = manifest.dumps(manifest.build(root))
        assert now not in seen
        seen.add(now)


def test_an_unchanged_file_is_not_read_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = folder(tmp_path)
    state_file = tmp_path / "state" / "state.json"
    out = tmp_path / "m.json"
    manifest.write(root, out, state_file)
    first = out.read_bytes()
    read: list[Path] = []
    real = manifest._sha256
    monkeypatch.setattr(manifest, "_sha256", lambda path: read.append(path) or real(path))
    manifest.write(root, out, state_file)
    assert read == [] and out.read_bytes() == first
    (root / "a.png").write_bytes(b"\x89PNG edited")
    manifest.write(root, out, state_file)
    assert read == [root / "a.png"]


def test_the_pipeline_versions_the_data_folder_through_its_manifest() -> None:
    """dvc.yaml: ingest depends on the manifest of ingest.data_dir, never on the folder itself
    (DVC would open every file in it), and the manifest stage runs in every `dvc repro`."""
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    (found,) = manifest_stages(stages, params)
    assert found.data == params["ingest"]["data_dir"]
    assert stages[found.name]["always_changed"] is True
    assert found.out in stages["ingest"]["deps"]
    assert not [d for d in stages["ingest"]["deps"] if "data_dir" in str(d)]
    names = list(stages)
    assert names.index(found.name) < names.index("ingest")  # the flow runs them in this order
    assert unwatched_sources(REPO) == []


def test_the_nightly_compares_the_folder_with_the_manifest_dvc_lock_records(tmp_path: Path) -> None:
    root = tmp_path
    data = folder(root)
    (root / "params.yaml").write_text(yaml.safe_dump({"ingest": {"data_dir": "data"}}))
    stages = {"data_manifest": {"cmd": f"{manifest.COMMAND} --data ${{ingest.data_dir}} --out m.json",
                                "always_changed": True, "outs": ["m.json"]},
              "ingest": {"cmd": "true", "deps": ["m.json"]}}
    (root / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}))

    def lock() -> None:
        md5 = hashlib.md5(manifest.dumps(manifest.build(Path("data")))).hexdigest()
        (root / "dvc.lock").write_text(yaml.safe_dump({"schema": "2.0", "stages": {"data_manifest": {
            "cmd": "x", "outs": [{"path": "m.json", "md5": md5, "size": 1}]}}}))

    cwd = Path.cwd()
    os.chdir(root)
    try:
        lock()
        assert manifest_changes(root) == ({"data_manifest"}, [])
        os.mkfifo(data / "evil.png")
        names, reasons = manifest_changes(root)
        assert reasons == ["stage 'data_manifest': the data folder data differs from the manifest dvc.lock "
                           "records (m.json): new, edited or removed files"]
        lock()
        assert manifest_changes(root)[1] == []
    finally:
        os.chdir(cwd)


def test_the_manifest_stage_runs_with_no_credential(tmp_path: Path) -> None:
    """It only lists the data folder: its process holds none of the secrets `dvc` was given (MLflow's,
    the hub's, the DVC remote's), and with a tracking server named it is not relayed (it logs no run),
    so it runs even where that server does not answer."""
    import json
    import subprocess
    import sys

    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(  # the environment of the process that does the work, at its exit
        "import atexit, json, os\n"
        "atexit.register(lambda: open(os.environ['ENV_DUMP'], 'w').write(json.dumps(sorted(os.environ))))\n")
    secrets = {"MLFLOW_TRACKING_USERNAME": "pipeline", "MLFLOW_TRACKING_PASSWORD": "pw", "HF_TOKEN": "hf",
               "AWS_SECRET_ACCESS_KEY": "s3"}
    env = {**os.environ, **secrets, "MLFLOW_TRACKING_URI": "http://127.0.0.1:9", "ENV_DUMP": str(tmp_path / "env"),
           "PYTHONPATH": os.pathsep.join([str(hook), str(REPO)])}
    out = tmp_path / "manifest.json"
    done = subprocess.run([sys.executable, "-m", "tasks.ingest.manifest", "--data", str(folder(tmp_path)),
                           "--out", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(json.loads(out.read_text())["entries"]) == 3
    held = set(json.loads((tmp_path / "env").read_text()))
    assert "ENV_DUMP" in held and not held & set(secrets), held & set(secrets)
