"""The MLflow UI, served by the real `mlflow server` on loopback, in headless Chromium (Debian's
`chromium` package): the registered model's page shows its versions and aliases, and a version
registered by tasks/register shows at a glance what it is (base, method, data hash, git commit,
primary metric, gate, protocol and its calibration, the champion decision), its scores and the
fine-tune's evaluation grid, served by the tracking server from the version's run. Screenshots are
kept as artifacts of the test run: .pytest_cache/d/screenshots/mlflow-*.png."""
from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import mlflow
import pytest

from tests.e2e_util import free_port, stop_process_group
from tests.register.conftest import write_plots

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium package "
                       "(apt-get install chromium; .ci/run installs it) for the headless browser"),
]


def _chromium(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--window-size=1400,900", "--virtual-time-budget=20000", *args],
        capture_output=True, text=True, timeout=timeout)


def _visible_text(dom: str) -> str:
    """The page's text as a reader sees it (tags, scripts and styles dropped)."""
    dom = re.sub(r"(?is)<(script|style)[^>]*>.*?</\1>", " ", dom)
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"(?s)<[^>]+>", " ", dom)))


class _Server:
    def __init__(self, store: str, log: Path) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        port = self.url.rsplit(":", 1)[1]
        with open(log, "wb") as sink:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", port,
                 "--workers", "1", "--backend-store-uri", store],
                stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        for _ in range(300):
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5):
                    return
            except (urllib.error.URLError, OSError):
                assert self.proc.poll() is None, log.read_text()[-3000:]
                time.sleep(1)

    def page(self, fragment: str, shot: Path) -> str:
        """The page's visible text; its screenshot is written to `shot`."""
        dom = _chromium("--dump-dom", f"{self.url}/#/{fragment}")
        assert dom.returncode == 0, dom.stderr[-3000:]
        self.dom = dom.stdout
        taken = _chromium(f"--screenshot={shot}", f"{self.url}/#/{fragment}")
        assert taken.returncode == 0 and shot.stat().st_size > 10_000, taken.stderr[-3000:]
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        print(f"\nscreenshot of {fragment}: {shot}")
        return _visible_text(dom.stdout)


@pytest.mark.timeout(900)
def test_a_registered_version_shows_what_it_is(project: Path, isolated_mlflow: str,
                                               tmp_path: Path,
                                               request: pytest.FixtureRequest) -> None:
    """Registered by tasks/register from the tiny models, with an uncalibrated evaluation."""
    from tasks.register.core import register

    report = json.loads((project / "reports/evaluate.json").read_text())
    report["protocol"] = {"id": "0a1b2c3d4e5f", "calibrated": False, "settings": {},
                          "uncalibrated_reason": "uncalibrated scores: builtin:tiny-clip and "
                          "builtin:tiny-dino have random (seeded) weights"}
    (project / "reports/evaluate.json").write_text(json.dumps(report))
    (project / "params.yaml").write_text("register:\n  model_name: sd-test\n"
                                         "  promote_uncalibrated: true\n")
    lock = (project / "dvc.lock").read_text()
    (project / "dvc.lock").write_text(lock.replace("stages:\n", (
        "stages:\n  base:\n    cmd: python -m tasks.base --out models/base\n    params:\n"
        "      params.yaml:\n        base:\n          model: builtin:tiny-sd\n"), 1))
    write_plots(project / "reports")  # the evaluate stage's grids, the train stage's loss table
    result = register(project / "models/finetuned", project / "models/openvino",
                      project / "reports/evaluate.json", project / "dvc.lock",
                      project / "params.yaml", train_report=project / "reports/train.json",
                      grids=project / "reports/evaluate",
                      loss_table=project / "reports/train_loss.csv")
    mv = mlflow.MlflowClient().get_model_version("sd-test", result.version)
    # a few tags (registration: its state; what trained: train.*), not one per hash and parameter
    assert len([t for t in mv.tags if not t.startswith("train.")]) <= 16, sorted(mv.tags)

    server = _Server(isolated_mlflow, tmp_path / "server.log")
    shots = Path(request.config.cache.mkdir("screenshots"))
    try:
        model_page = server.page("models/sd-test", shots / "mlflow-model-versions.png")
        assert "Version 1" in model_page and "champion" in model_page
        version_page = server.page(f"models/sd-test/versions/{result.version}",
                                   shots / "mlflow-model-version.png")
        # the fine-tune's grid on the version's page: an image the server serves from the version's run
        (src,) = re.findall(r'<img[^>]* src="([^"]*story%2Fgrid\.png[^"]*)"', server.dom)
        with urllib.request.urlopen(f"{server.url}/{html.unescape(src)}", timeout=30) as answer:
            grid = answer.read()
        assert grid == (project / "reports/evaluate/grid.png").read_bytes()
    finally:
        stop_process_group(server.proc)
    facts = {
        "base": "builtin:tiny-sd fine-tuned with dreambooth", "method": "dreambooth",
        "data hash": "11111111111111111111111111111111.dir",
        "git commit": mv.tags["git_commit"], "primary metric": "metric.dino", "score": "0.4",
        "gate": "passed", "protocol": "0a1b2c3d4e5f (uncalibrated)",
        "scores": "clip_i=0.5, clip_t=0.21, dino=0.4", "family": "sd", "task": "text-to-image",
        "uncalibrated, in words": "Uncalibrated scores: builtin:tiny-clip and builtin:tiny-dino",
        "champion decision": "promoted: the gate passed and there was no champion",
    }
    missing = [what for what, text in facts.items() if text not in version_page]
    assert not missing, f"not visible on the version page: {missing}\n{version_page[:3000]}"


@pytest.mark.timeout(600)
def test_model_page_shows_the_model_and_its_aliases(tmp_path: Path, isolated_mlflow: str,
                                                    request: pytest.FixtureRequest) -> None:
    client = mlflow.MlflowClient()
    client.create_registered_model("sd-ui-check", description="screenshot test")
    for _ in range(2):
        client.create_model_version("sd-ui-check", source=str(tmp_path))
    client.set_registered_model_alias("sd-ui-check", "candidate", "2")
    client.set_registered_model_alias("sd-ui-check", "champion", "1")

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "server.log"
    with open(log, "wb") as sink:
        server = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
             "--workers", "1", "--backend-store-uri", isolated_mlflow],
            stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        for _ in range(300):
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5):
                    break
            except (urllib.error.URLError, OSError):
                assert server.poll() is None, log.read_text()[-3000:]
                time.sleep(1)
        page = f"{url}/#/models/sd-ui-check"
        dom = _chromium("--dump-dom", page)
        assert dom.returncode == 0, dom.stderr[-3000:]
        assert "sd-ui-check" in dom.stdout
        assert "@champion" in dom.stdout or "champion" in dom.stdout
        assert "candidate" in dom.stdout
        shots = Path(request.config.cache.mkdir("screenshots"))
        shot = shots / "mlflow-model-page.png"
        taken = _chromium(f"--screenshot={shot}", page)
        assert taken.returncode == 0 and shot.stat().st_size > 10_000, taken.stderr[-3000:]
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        print(f"\nscreenshot of {page}: {shot}")
    finally:
        stop_process_group(server)
