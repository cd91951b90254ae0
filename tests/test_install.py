"""The set-up a new user gets: the Python check in the Makefile, and what a stock pip resolves.

The pip tests run pip with no local configuration (no config file, no find-links, no
extra indexes) against the public indexes, so a pin that installs only because this machine
carries a wheel of its own is caught. Where the network cannot reach an index, only that part
skips, with the reason.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

from tests.conftest import REPO

PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# The side environments' locks (make side-envs), on top of requirements.lock.
SIDE_LOCKS = ("requirements-xla.lock", "requirements-ipex.lock", "requirements-bench.lock")
TORCH_LOCK = "requirements-torch.lock"


def makefile_python() -> str:
    match = re.search(r"^PYTHON_NEEDED := (\S+)$", (REPO / "Makefile").read_text(), re.M)
    assert match, "Makefile defines no PYTHON_NEEDED"
    return match.group(1)


def test_the_makefile_asks_for_the_python_pyproject_allows() -> None:
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    spec = SpecifierSet(project["requires-python"])
    major, minor = map(int, makefile_python().split("."))
    assert spec.contains(f"{major}.{minor}.0") and spec.contains(f"{major}.{minor}.20")
    assert not spec.contains(f"{major}.{minor + 1}.0")
    assert not spec.contains(f"{major}.{minor - 1}.20")


def fake_python(path: Path, version: str) -> Path:
    """An executable that answers the Makefile's version question as Python `version` would."""
    path.write_text(f"#!/bin/sh\necho {version}\n")
    path.chmod(0o755)
    return path


@pytest.fixture
def project_copy(tmp_path: Path) -> Path:
    for name in ("Makefile", "pyproject.toml", "requirements.lock", TORCH_LOCK):
        shutil.copy(REPO / name, tmp_path / name)
    return tmp_path


def make(project: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "--no-print-directory", *args], cwd=project,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("target", ["install", "demo", "test"])
def test_a_wrong_python_stops_at_once_saying_what_to_get(project_copy: Path, target: str) -> None:
    wrong = fake_python(project_copy / "python3.12", "3.12")
    done = make(project_copy, target, f"PYTHON={wrong}")
    assert done.returncode != 0
    assert f"this project needs Python {makefile_python()}" in done.stdout
    assert f"{wrong} is 3.12" in done.stdout
    assert "apt-get install python3.11 python3.11-venv" in done.stdout
    assert f"make {target} PYTHON=python3.11" in done.stdout
    assert not (project_copy / ".venv").exists(), "no environment is made with the wrong Python"


def test_a_missing_python_is_named(project_copy: Path) -> None:
    done = make(project_copy, "install", "PYTHON=no-such-python3")
    assert done.returncode != 0
    assert "no-such-python3 is not a working Python" in done.stdout


def test_an_environment_made_with_another_python_is_named_with_the_fix(project_copy: Path) -> None:
    fake_python(project_copy / "python3.12", "3.12")
    (project_copy / ".venv" / "bin").mkdir(parents=True)
    fake_python(project_copy / ".venv" / "bin" / "python", "3.12")
    done = make(project_copy, "install")
    assert done.returncode != 0
    assert ".venv/bin/python is 3.12" in done.stdout
    assert "rm -rf .venv && make install PYTHON=python3.11" in done.stdout
    assert not (project_copy / ".venv" / ".installed").exists()


# --- reinstalling only what changed, never another checkout's environment -----------------


def venv_of(project: Path, editable: Path | None = None) -> Path:
    """A real, empty .venv (no pip: an install it tried would fail at once) in `project`; with
    `editable`, the project's dist-info in it as uv writes it for `pip install -e <editable>`."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(project / ".venv")], check=True)
    if editable is not None:
        python = project / ".venv" / "bin" / "python"
        purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 capture_output=True, text=True, check=True).stdout.strip()
        info = Path(purelib) / "sd_finetune_pipeline-0.1.0.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sd-finetune-pipeline\nVersion: 0.1.0\n")
        (info / "direct_url.json").write_text(json.dumps({"url": editable.as_uri(), "dir_info": {"editable": True}}))
    return project / ".venv"


def test_make_install_reinstalls_when_a_lock_s_content_changes_not_its_timestamp(project_copy: Path) -> None:
    venv = venv_of(project_copy)
    stamp = venv / ".installed"
    stamp.touch()  # an environment installed under the old rule (an empty stamp, newer than the locks)
    mtime = stamp.stat().st_mtime_ns
    adopted = make(project_copy, "install")
    assert adopted.returncode == 0, adopted.stdout + adopted.stderr
    assert "its stamp now holds their hash" in adopted.stdout and "installing" not in adopted.stdout
    assert re.fullmatch(r"[0-9a-f]{64}\n", stamp.read_text()) and stamp.stat().st_mtime_ns == mtime
    later = stamp.stat().st_mtime + 3600  # a fresh clone's files: all newer than the stamp
    for name in ("Makefile", "pyproject.toml", "requirements.lock", TORCH_LOCK):
        os.utime(project_copy / name, (later, later))
    assert make(project_copy, "-q", "install").returncode == 0, "new timestamps, same contents: up to date"
    assert "pip install" not in make(project_copy, "-n", "install").stdout
    lock = project_copy / "requirements.lock"
    text = lock.read_text()
    lock.write_text(text + "# a changed line\n")
    assert make(project_copy, "-q", "install").returncode == 1, "a lock's content changed: install again"
    assert "$(BIN)/pip install" in make(project_copy, "-n", "install").stdout.replace(".venv/bin", "$(BIN)")
    lock.write_text(text)
    assert make(project_copy, "-q", "install").returncode == 0


@pytest.mark.parametrize("owner", ["another checkout", "a removed checkout", "this checkout"])
def test_a_venv_another_checkout_installed_is_never_re_pointed(tmp_path: Path, owner: str) -> None:
    project = tmp_path / "clone"
    project.mkdir()
    for name in ("Makefile", "pyproject.toml", "requirements.lock", TORCH_LOCK):
        shutil.copy(REPO / name, project / name)
    other = {"another checkout": tmp_path / "first", "a removed checkout": tmp_path / "gone",
             "this checkout": project}[owner]
    if owner == "another checkout":
        other.mkdir()
    venv = venv_of(project, editable=other)
    (venv / ".installed").write_text("0" * 64 + "\n")  # installed from other locks: an install is due
    done = make(project, "install")
    assert done.returncode != 0  # this environment has no pip: any install attempt fails
    if owner == "another checkout":
        assert f"error: .venv is the environment of another checkout: its editable install of " \
               f"sd-finetune-pipeline points at {other};" in done.stdout, done.stdout
        assert "unlink .venv if it is a link to that one (rm -rf .venv if it is a copy), then make install" \
            in done.stdout
        assert "installing pinned dependencies" not in done.stdout, "nothing was installed"
    else:  # nobody else uses it (gone), or it is this checkout's own: install as usual
        assert "installing pinned dependencies into .venv" in done.stdout, done.stdout + done.stderr
        assert "another checkout" not in done.stdout
    assert (venv / ".installed").read_text() == "0" * 64 + "\n", "the stamp changes only after an install"


# --- what a stock pip resolves --------------------------------------------------------------


def pins(lock: str) -> dict[str, str]:
    """{canonical name: version} of a lock's `name==version` lines."""
    found = {}
    for line in (REPO / lock).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            name, sep, version = line.partition("==")
            assert sep, f"{lock}: {line!r} is not an exact pin"
            found[canonicalize_name(name)] = version
    return found


def reachable(host: str) -> str | None:
    """None when `host`:443 accepts a connection, else why not."""
    try:
        socket.create_connection((host, 443), timeout=10).close()
    except OSError as err:
        return f"{host} is not reachable from this machine ({err})"
    return None


def stock_pip(lock: Path, report: Path) -> subprocess.CompletedProcess:
    """`pip install --dry-run` of one lock as on a fresh machine: no config, no local wheels."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env |= {"PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps",
               "--ignore-installed", "--quiet", "--report", str(report), "-r", str(lock)]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)


def stock_uv(lock: Path, tmp: Path) -> subprocess.CompletedProcess:
    """`uv pip install --dry-run` of one lock into an empty venv: no uv config, an empty cache."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UV_", "PIP_"))}
    env |= {"UV_NO_CONFIG": "1", "UV_CACHE_DIR": str(tmp / "uv-cache")}
    uv = str(Path(sys.executable).parent / "uv")
    subprocess.run([uv, "venv", "--quiet", "--python", sys.executable, str(tmp / "venv")],
                   env=env, check=True, capture_output=True)
    return subprocess.run([uv, "pip", "install", "--dry-run", "--no-deps", "--python",
                           str(tmp / "venv" / "bin" / "python"), "-r", str(lock)],
                          env=env, capture_output=True, text=True, timeout=300)


def needs(host: str) -> None:
    if why := reachable(host):
        pytest.skip(f"{why}: the public index cannot be asked here")


@pytest.mark.e2e
@pytest.mark.parametrize("lock", ["requirements.lock", *SIDE_LOCKS])
def test_a_stock_uv_resolves_every_pin_of_each_lock_from_pypi(tmp_path: Path, lock: str) -> None:
    """`make install` and `make side-envs` install these with uv (--no-deps), as on a fresh
    machine: no uv or pip configuration, an empty cache. uv reads wheel metadata; pip's dry run
    would download every wheel (4 GB of CUDA packages for the side locks)."""
    needs("pypi.org")
    done = stock_uv(REPO / lock, tmp_path)
    assert done.returncode == 0, f"a stock uv cannot install {lock}:\n{done.stderr[-3000:]}"
    resolved = dict(line.split(" + ", 1)[1].split("==", 1) for line in done.stderr.splitlines()
                    if line.startswith(" + "))
    assert {canonicalize_name(k): v for k, v in resolved.items()} == pins(lock)


def test_make_install_installs_the_locks_with_the_pinned_uv() -> None:
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^UV_PIN := \$\(shell grep -E '\^uv==' requirements\.lock\)$", makefile, re.M)
    assert "$(UV_PIP) --compile-bytecode --no-deps -r requirements.lock" in makefile
    assert "uv" in pins("requirements.lock")


def test_torch_is_pinned_to_pytorchs_cpu_index_only() -> None:
    """torch's CPU build is declared against PyTorch's index, in its own lock and nowhere else."""
    options = [line.split() for line in (REPO / TORCH_LOCK).read_text().splitlines()
               if line.startswith("-")]
    assert options == [["--index-url", PYTORCH_CPU_INDEX]]
    torch = pins(TORCH_LOCK)
    assert list(torch) == ["torch"] and torch["torch"].endswith("+cpu")
    wanted = re.search(r"^torch==(\S+)$", (REPO / "requirements.in").read_text(), re.M)
    assert wanted and torch["torch"] == f"{wanted.group(1)}+cpu"
    assert "torch" not in pins("requirements.lock")


@pytest.mark.e2e
def test_pypi_alone_does_not_have_the_cpu_torch(tmp_path: Path) -> None:
    """Why torch has its own index: the `+cpu` build is not on PyPI (a pin that would fail)."""
    needs("pypi.org")
    lock = tmp_path / "torch-from-pypi.lock"
    lock.write_text(f"torch=={pins(TORCH_LOCK)['torch']}\n")
    done = stock_pip(lock, tmp_path / "report.json")
    assert done.returncode != 0
    assert "No matching distribution found for torch==" in done.stderr


@pytest.mark.e2e
def test_a_stock_pip_resolves_torch_from_pytorchs_index(tmp_path: Path) -> None:
    if why := reachable("download.pytorch.org"):
        pytest.skip(f"{why}; its pin is checked against the index it names only "
                    "(test_torch_is_pinned_to_pytorchs_cpu_index_only)")
    done = stock_pip(REPO / TORCH_LOCK, tmp_path / "report.json")
    assert done.returncode == 0, done.stderr[-3000:]
    [item] = json.loads((tmp_path / "report.json").read_text())["install"]
    assert item["metadata"]["version"] == pins(TORCH_LOCK)["torch"]
    assert item["download_info"]["url"].startswith("https://download.pytorch.org/")


@pytest.mark.e2e
def test_where_pytorchs_index_is_out_of_reach_pypi_has_the_same_torch(tmp_path: Path) -> None:
    """`make install`'s fallback: PyPI's build of the pinned version (with its CUDA packages)."""
    needs("pypi.org")
    version = pins(TORCH_LOCK)["torch"].removesuffix("+cpu")
    assert re.search(r"^TORCH_PIN := .*requirements\.in", (REPO / "Makefile").read_text(), re.M)
    lock = tmp_path / "torch-from-pypi.lock"
    lock.write_text(f"torch=={version}\n")
    done = stock_uv(lock, tmp_path)
    assert done.returncode == 0, f"PyPI has no torch=={version}:\n{done.stderr[-3000:]}"
    assert f" + torch=={version}" in done.stderr
