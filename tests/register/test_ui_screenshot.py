"""The MLflow UI's model page, served by the real `mlflow server` on loopback, shows the registered
model and its aliases in headless Chromium (Debian's `chromium` package). The screenshot is kept as
an artifact of the test run: .pytest_cache/d/screenshots/mlflow-model-page.png."""
from __future__ import annotations

import os
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
