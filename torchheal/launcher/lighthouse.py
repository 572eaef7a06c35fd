"""A lighthouse with its dashboard, run inside the launcher's process for a local job.

``torchheal launch`` and ``torchheal demo`` start one so that a local job needs nothing else;
the launcher reads the dashboard's status document for its progress line and report.
"""

from __future__ import annotations

import functools
from typing import Any

from torchheal._base.security import SecurityEnv
from torchheal.coordination import LighthouseServer
from torchheal.coordination.lighthouse.dashboard import (
    DEFAULT_DASHBOARD_PORT,
    DashboardServer,
    LighthouseRecorder,
)
from torchheal.coordination.lighthouse.dashboard.server import kill_replica
from torchheal.launcher.progress import fetch_status

__all__ = ["LocalLighthouse"]


class LocalLighthouse:
    """A lighthouse on loopback and its dashboard; both start in the constructor.

    Args:
        min_replicas: fewest replica groups a quorum needs.
        join_timeout_ms: how long the lighthouse waits for stragglers.
        heartbeat_timeout_ms: how long a silent group stays a member.
        dashboard_port: 0 picks a free port; None tries 29511, else a free one.
        token: the job token the dashboard's kill action needs (None: open).
        host: where both listen (loopback: the kill action is open without a token).
        security: token and TLS settings of the lighthouse and the kill calls (None: from the
            environment).

    Raises:
        RuntimeError: a port could not be bound.
    """

    def __init__(
        self,
        min_replicas: int = 1,
        join_timeout_ms: int = 1000,
        heartbeat_timeout_ms: int = 2000,
        dashboard_port: int | None = None,
        token: str | None = None,
        host: str = "127.0.0.1",
        security: SecurityEnv | None = None,
    ) -> None:
        security = SecurityEnv.from_env() if security is None else security
        # The kill action calls managers with the lighthouse's settings, which a command's
        # flags may have given without ever being in this process's environment.
        self._kill = functools.partial(kill_replica, security=security)
        self._recorder = LighthouseRecorder()
        self.server = LighthouseServer(
            bind=f"{host}:0",
            min_replicas=min_replicas,
            join_timeout_ms=join_timeout_ms,
            heartbeat_timeout_ms=heartbeat_timeout_ms,
            observer=self._recorder,
            security=security,
        )
        self.address = f"http://{host}:{self.server.address().rsplit(':', 1)[1]}"
        try:
            self.dashboard = self._dashboard(host, dashboard_port, token)
        except BaseException:
            self.server.shutdown()
            raise
        self.dashboard_url = self.dashboard.url(host)
        self._fetch = fetch_status(self.dashboard_url)

    def _dashboard(self, host: str, port: int | None, token: str | None) -> DashboardServer:
        def serve(port: int) -> DashboardServer:
            return DashboardServer(
                self.server, self._recorder, host=host, port=port, token=token, kill=self._kill
            )

        if port is not None:
            return serve(port)
        try:
            return serve(DEFAULT_DASHBOARD_PORT)
        except RuntimeError:  # 29511 is taken (another lighthouse, another demo): any port
            return serve(0)

    def status(self) -> dict[str, Any] | None:
        """The dashboard's status document (None when it cannot be read)."""
        return self._fetch()

    def shutdown(self) -> None:
        """Stops the dashboard and the lighthouse."""
        try:
            self.dashboard.shutdown()
        finally:
            self.server.shutdown()
