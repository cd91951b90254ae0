"""The flow's entry turns Prefect's telemetry off where the environment says nothing (an offline run's
temporary server would log "Failed to send telemetry" as an ERROR), and keeps what the user set."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from flows import TELEMETRY_OFF
from tests.conftest import REPO

pytestmark = pytest.mark.quick  # make test-fast

#: what the flow's process holds once its module is imported: the variables, and Prefect's own reading
SETTINGS = """
import json, os, sys
import flows.finetune
from prefect._internal.analytics.enabled import is_telemetry_enabled
from prefect.settings import get_current_settings
print(json.dumps({"env": {k: os.environ.get(k) for k in sys.argv[1:]},
                  "server_analytics": get_current_settings().server.analytics_enabled,
                  "sdk_telemetry": is_telemetry_enabled()}))
"""


def _flow_settings(**env: str) -> dict:
    base = {k: v for k, v in os.environ.items() if k not in TELEMETRY_OFF}
    proc = subprocess.run([sys.executable, "-c", SETTINGS, *TELEMETRY_OFF], cwd=REPO,
                          env={**base, "PYTHONPATH": str(REPO), **env}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_the_flow_turns_prefect_telemetry_off_where_unset() -> None:
    seen = _flow_settings()
    assert seen == {"env": {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1"},
                    "server_analytics": False, "sdk_telemetry": False}


def test_the_flow_keeps_the_users_telemetry_settings() -> None:
    seen = _flow_settings(PREFECT_SERVER_ANALYTICS_ENABLED="true", DO_NOT_TRACK="0")
    assert seen["env"] == {"PREFECT_SERVER_ANALYTICS_ENABLED": "true", "DO_NOT_TRACK": "0"}
    assert seen["server_analytics"] is True  # (the SDK's also reads CI variables: not asserted)
