"""The lighthouse's live dashboard: a web page, its JSON status and Prometheus metrics.

Served by the lighthouse process on its own HTTP port (default 29511)::

    recorder = LighthouseRecorder()
    lighthouse = LighthouseServer(bind="[::]:29510", min_replicas=2, observer=recorder)
    dashboard = DashboardServer(lighthouse, recorder, port=29511)
    print("dashboard:", dashboard.url())

The page lives in ``static/``; its chart library in ``static/vendor/`` is fetched from the npm
registry at set-up time (pinned by ``package.json``/``package-lock.json`` beside this file).
"""

from torchheal.coordination.lighthouse.dashboard.recorder import LighthouseRecorder
from torchheal.coordination.lighthouse.dashboard.server import (
    DEFAULT_DASHBOARD_PORT,
    DashboardServer,
)

__all__ = ["DEFAULT_DASHBOARD_PORT", "DashboardServer", "LighthouseRecorder"]
