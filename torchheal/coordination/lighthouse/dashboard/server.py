"""The dashboard's HTTP server: aiohttp on its own event-loop thread, beside the lighthouse.

Its own thread, because the lighthouse's loop must not wait behind a browser, a scrape or a kill
RPC. The read-only pages are open to anyone who reaches the port, so :class:`HttpLimits` bounds
what a client can make it hold (aiohttp's defaults: ~1.6 MiB a connection for an hour, no cap).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import socket
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from aiohttp import web

from torchheal._base.security import SecurityEnv
from torchheal.coordination.lighthouse.dashboard.app import STATIC_DIR, DashboardApp
from torchheal.coordination.lighthouse.dashboard.recorder import LighthouseRecorder
from torchheal.coordination.rpc.addresses import format_target
from torchheal.coordination.rpc.auth import RefusalLog

__all__ = ["DEFAULT_DASHBOARD_PORT", "LIMITS", "DashboardServer", "HttpLimits"]

logger: logging.Logger = logging.getLogger(__name__)

#: The dashboard's default port, next to the lighthouse's 29510.
DEFAULT_DASHBOARD_PORT = 29511
# How often queued lighthouse events are folded into the history when nobody is looking.
SYNC_INTERVAL_S = 0.25


@dataclass(frozen=True)
class HttpLimits:
    """What clients may make the dashboard hold.

    Args:
        connections: the most open connections; a new one closes the oldest.
        idle_s: how long a connection may go without a complete request.
        header_lines: the most header lines of a request (each at most 8 KiB).
        handshake_s: how long a TLS handshake may take.
    """

    connections: int = 128
    idle_s: float = 30.0
    header_lines: int = 32
    handshake_s: float = 10.0


#: The limits a dashboard is made with unless told others.
LIMITS = HttpLimits()


class _Gate(asyncio.Protocol):
    """Keeps at most ``limit`` connections open; a new one closes the oldest to make room.

    The oldest: a page's request is answered within moments, so a crowd of slow clients cannot
    keep readers out unless renewed faster. Counted once connected (after TLS's handshake): a
    failed handshake never reports its end to the protocol it wraps.
    """

    def __init__(
        self,
        handlers: Callable[[], Any],
        open_: dict[_Gate, None],
        limit: int,
        refusals: RefusalLog,
    ) -> None:
        self._handlers = handlers
        self._handler: Any = None  # aiohttp's, made once connected
        self._transport: asyncio.Transport | None = None
        self._open = open_
        self._limit = limit
        self._refusals = refusals

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        if len(self._open) >= self._limit:
            oldest = next(iter(self._open))
            del self._open[oldest]
            assert oldest._transport is not None  # set before it joined
            peer = oldest._transport.get_extra_info("peername")
            self._refusals.refused("the oldest dashboard connection", peer, f"{self._limit} open")
            oldest._transport.abort()
        self._open[self] = None
        self._transport = transport
        self._handler = self._handlers()
        self._handler.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self._handler.data_received(data)

    def eof_received(self) -> bool | None:
        return self._handler.eof_received()

    def pause_writing(self) -> None:
        self._handler.pause_writing()

    def resume_writing(self) -> None:
        self._handler.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._open.pop(self, None)
        if self._handler is not None:
            self._handler.connection_lost(exc)


def kill_replica(address: str, message: str, *, security: SecurityEnv | None = None) -> None:
    """Ask the manager server at ``address`` to exit (its ``Kill`` RPC), logging ``message``.

    ``security``: the token and TLS settings to call with (None: the client reads the
    environment). Raises RuntimeError (unreachable, refused) or TimeoutError.
    """
    # Imported here: only the kill action needs a gRPC client.
    from torchheal.coordination.clients.manager_client import ManagerClient

    client = ManagerClient(address, connect_timeout=timedelta(seconds=5), security=security)
    try:
        client.kill(message, timeout=timedelta(seconds=5))
    finally:
        client.close()


class DashboardServer:
    """Serves the dashboard of a lighthouse; starts in the constructor.

    Args:
        lighthouse: anything with ``status()`` and ``address()``.
        recorder: the observer the lighthouse was created with.
        host: address to listen on; ``"::"`` (default): every IPv6 and IPv4 address.
        port: TCP port; 0 picks a free one.
        token: the job token actions need (None or empty: actions are open).
        kill: replaces :func:`kill_replica` (tests).
        metrics_auth: ``/metrics`` needs the token too.
        ssl_context: serve HTTPS with this context; None: HTTP.

    Raises:
        RuntimeError: the port could not be bound.
    """

    def __init__(
        self,
        lighthouse: Any,
        recorder: LighthouseRecorder,
        host: str = "::",
        port: int = DEFAULT_DASHBOARD_PORT,
        token: str | None = None,
        kill: Callable[[str, str], None] = kill_replica,
        static_dir: Path = STATIC_DIR,
        metrics_auth: bool = False,
        ssl_context: ssl.SSLContext | None = None,
        limits: HttpLimits | None = None,
    ) -> None:
        self.limits = LIMITS if limits is None else limits
        self.app = DashboardApp(
            lighthouse.status,
            recorder,
            kill,
            token=token,
            address=lighthouse.address(),
            static_dir=static_dir,
            metrics_auth=metrics_auth,
        )
        self._ssl = ssl_context
        sock = _listen(host, port)
        self._port = sock.getsockname()[1]
        self._loop = asyncio.new_event_loop()
        self._stopped = threading.Event()
        self._runner: web.AppRunner | None = None
        self._listener: asyncio.AbstractServer | None = None
        self._open: dict[_Gate, None] = {}  # an ordered set: the oldest first
        ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._run, args=(sock, ready), name="torchheal-dashboard", daemon=True
        )
        self._thread.start()
        ready.result()

    @property
    def port(self) -> int:
        """The TCP port the dashboard listens on."""
        return self._port

    def url(self, host: str | None = None) -> str:
        """The page's URL, ``http(s)://{host}:{port}/`` (default host: this machine's name)."""
        scheme = "http" if self._ssl is None else "https"
        return f"{scheme}://{format_target(host or socket.gethostname(), self._port)}/"

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop serving and end the thread (waiting up to ``timeout``). Idempotent, thread-safe."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        with contextlib.suppress(RuntimeError):  # loop already closed
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)

    def _run(self, sock: socket.socket, ready: concurrent.futures.Future[None]) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._start(sock))
        except BaseException as e:
            sock.close()
            ready.set_exception(RuntimeError(f"dashboard failed to start: {e}"))
            self._loop.close()
            return
        ready.set_result(None)
        try:
            self._loop.run_forever()
        finally:
            if self._listener is not None:
                self._listener.close()
            if self._runner is not None:
                self._loop.run_until_complete(self._runner.cleanup())
            for task in asyncio.all_tasks(self._loop):
                task.cancel()
            self._loop.run_until_complete(asyncio.sleep(0))
            self._loop.close()

    async def _start(self, sock: socket.socket) -> None:
        limits = self.limits
        runner = web.AppRunner(
            self.app.build(),
            access_log=None,
            handle_signals=False,
            shutdown_timeout=1.0,
            keepalive_timeout=limits.idle_s,
            max_headers=limits.header_lines,
        )
        await runner.setup()
        handlers = runner.server
        assert handlers is not None
        refusals = RefusalLog(logger)
        # Served through the gate rather than a ``web.SockSite``, which has no connection cap.
        self._listener = await asyncio.get_running_loop().create_server(
            lambda: _Gate(handlers, self._open, limits.connections, refusals),
            sock=sock,
            ssl=self._ssl,
            ssl_handshake_timeout=limits.handshake_s if self._ssl is not None else None,
        )
        self._runner = runner
        self._loop.create_task(self._sync_forever())

    async def _sync_forever(self) -> None:
        while True:
            try:
                self.app.sync()
            except Exception:
                logger.exception("dashboard: folding lighthouse events failed")
            await asyncio.sleep(SYNC_INTERVAL_S)


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket; ``"::"`` also accepts IPv4 where the system allows it."""
    sock: socket.socket | None = None
    try:
        if host in ("::", "[::]", ""):
            try:
                sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
                host = "::"
            except OSError:  # no IPv6 on this machine
                if sock is not None:
                    sock.close()
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                host = "0.0.0.0"
        else:
            host = host.strip("[]")
            family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
            sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        sock.setblocking(False)
    except OSError as e:
        if sock is not None:
            sock.close()
        raise RuntimeError(
            f"dashboard: cannot listen on {format_target(host, port)}: {e.strerror or e}; "
            "choose another port with --dashboard_port (0 picks a free one)"
        ) from None
    return sock
