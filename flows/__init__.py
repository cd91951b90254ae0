"""Orchestration: the Prefect flow `finetune`, its server (`make serve`), the demo summary.

Importing this package (as `python -m flows.finetune` does, before its module imports Prefect, which
reads its settings as it is imported) turns Prefect's telemetry off where the environment says
nothing: the temporary server of a run without a server would otherwise try to reach Prefect's
telemetry service and, offline, log `ERROR | prefect.server.services.telemetry - Failed to send
telemetry` on every run. A value the user set is kept; the Makefile exports the same defaults.
"""
import os

#: set where unset, before Prefect is imported: the server's analytics, the SDK's (the DO_NOT_TRACK standard)
TELEMETRY_OFF = {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1"}

for _name, _value in TELEMETRY_OFF.items():
    os.environ.setdefault(_name, _value)
