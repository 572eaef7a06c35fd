"""The lighthouse's live dashboard: a web page, its JSON status and Prometheus metrics.

Served by the lighthouse process on its own HTTP port (default 29511)::

    recorder = LighthouseRecorder()
    lighthouse = LighthouseServer(bind="[::]:29510", min_replicas=2, observer=recorder)
    dashboard = DashboardServer(lighthouse, recorder, port=29511)
    print("dashboard:", dashboard.url())

Modules, from the bottom: ``events.py`` (what the lighthouse reports, as values),
``history.py`` (the pure fold of events into quorum history, recovery timeline and charts),
``view.py`` (the pure status document), ``terminal.py`` (the status document as text),
``recorder.py`` (the lighthouse observer), ``app.py`` (HTTP routes), ``server.py`` (the
thread that serves them). The page lives in ``static/``; its chart library in
``static/vendor/`` is fetched from the npm registry at set-up time (``package.json``/
``package-lock.json`` beside this file pin it).
"""

from torchheal.coordination.lighthouse.dashboard.recorder import LighthouseRecorder
from torchheal.coordination.lighthouse.dashboard.server import (
    DEFAULT_DASHBOARD_PORT,
    DashboardServer,
)

__all__ = ["DEFAULT_DASHBOARD_PORT", "DashboardServer", "LighthouseRecorder"]
