"""What a client can make the HTTP checkpoint server hold before its request has been read.

The server gives every connection a thread and checks the token only once a request's head is
complete, so anyone reaching the port can hold a thread. :class:`HttpLimits` bounds that; past
the cap a newcomer closes the oldest connection still sending its head. Connections being
answered never count, so honest healers are never turned away.

:class:`Gate` decides (plain data and ``now``); :class:`LimitedServer` and
:class:`LimitedHandler`, mixed into the stdlib server and handler, close what it says.
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
import time
from collections.abc import Hashable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from socketserver import TCPServer
from typing import Any, BinaryIO

from torchheal.coordination.rpc.auth import RefusalLog

__all__ = ["LIMITS", "Gate", "HeadRefused", "HttpLimits", "LimitedHandler", "LimitedServer"]

# A child of the server's logger, so configuring that one configures this one too.
logger = logging.getLogger("torchheal.checkpointing.http_transport.limits")


@dataclass(frozen=True)
class HttpLimits:
    """What connections may make the checkpoint server hold.

    Args:
        connections: the most open connections awaiting a request head (each a thread).
        head_s: how long a request head may take, from accepting the connection or the end of
            the previous answer.
        head_bytes: the most bytes of a request head (answered 431 when over).
    """

    connections: int = 256
    head_s: float = 10.0
    head_bytes: int = 64 * 1024


#: The limits a server is made with unless told others.
LIMITS = HttpLimits()


class HeadRefused(Exception):
    """A request head that the limits end: its connection is closed.

    ``why`` is None when already logged (the gate closed it); ``answer``: send 431 first.
    """

    def __init__(self, why: str | None, answer: bool = False) -> None:
        super().__init__(why or "closed by the connection limits")
        self.why = why
        self.answer = answer


@dataclass
class Connection:
    """An open connection: who, and since when its current head is awaited (None: answered)."""

    key: Hashable
    peer: Any
    head_since: float | None


class Gate:
    """The open connections and where each stands; says which to close, closes nothing.

    Thread-safe: the accepting thread admits and sweeps, each connection's thread reports.
    """

    def __init__(self, limits: HttpLimits) -> None:
        self.limits = limits
        self._lock = threading.Lock()
        self._open: dict[Hashable, Connection] = {}

    def admit(self, key: Hashable, peer: Any, now: float) -> Connection | None:
        """A new connection (always let in): the connection to close for it, if any.

        At the cap, the connection whose head was awaited longest makes room.
        """
        with self._lock:
            evicted = None
            heads = [c for c in self._open.values() if c.head_since is not None]
            if len(heads) >= self.limits.connections:
                evicted = min(heads, key=lambda c: c.head_since or 0.0)
                del self._open[evicted.key]
            self._open[key] = Connection(key, peer, now)
            return evicted

    def holds(self, key: Hashable) -> bool:
        """Whether ``key`` is still open (not closed by the gate, not gone)."""
        with self._lock:
            return key in self._open

    def head_begins(self, key: Hashable, now: float) -> bool:
        """A head is awaited on ``key`` (its first since admission, or the next); False: closed."""
        with self._lock:
            connection = self._open.get(key)
            if connection is not None and connection.head_since is None:
                connection.head_since = now
            return connection is not None

    def head_done(self, key: Hashable) -> bool:
        """``key``'s head is complete: it is being answered; False: it was closed first."""
        with self._lock:
            connection = self._open.get(key)
            if connection is not None:
                connection.head_since = None
            return connection is not None

    def late(self, now: float) -> list[Connection]:
        """The connections whose head is overdue at ``now``, let go of: close them."""
        with self._lock:
            due = now - self.limits.head_s
            late = [
                c for c in self._open.values() if c.head_since is not None and c.head_since <= due
            ]
            for connection in late:
                del self._open[connection.key]
            return late

    def drain(self) -> list[Connection]:
        """Every connection awaiting a head, let go of (the server stops): close them."""
        with self._lock:
            heads = [c for c in self._open.values() if c.head_since is not None]
            for connection in heads:
                del self._open[connection.key]
            return heads

    def leave(self, key: Hashable) -> None:
        """``key`` is closed (idempotent)."""
        with self._lock:
            self._open.pop(key, None)


def _end(connection: Connection) -> None:
    """Ends a connection whose thread may be blocked reading it: the read returns."""
    try:
        # The plain socket's shutdown, also under TLS: SSLSocket's would drop its TLS state
        # under the thread still reading it.
        socket.socket.shutdown(connection.key, socket.SHUT_RDWR)
    except OSError:
        pass  # already gone


class LimitedServer(TCPServer):
    """The server's side of the limits, mixed in before ``ThreadingHTTPServer``.

    Sweeps late heads once per poll of ``serve_forever`` (serve with a short ``poll_interval``).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.gate = Gate(LIMITS)
        self.limits_log = RefusalLog(logger)  # one line per 5 s at most
        super().__init__(*args, **kwargs)

    def _close(self, connection: Connection, why: str) -> None:
        self.limits_log.refused("a checkpoint-server connection", connection.peer, why)
        _end(connection)

    def verify_request(self, request: Any, client_address: Any) -> bool:
        evicted = self.gate.admit(request, client_address, time.monotonic())
        cap = self.gate.limits.connections
        if evicted is not None:
            self._close(evicted, f"{cap} open: closed the oldest awaiting a request head")
        return True

    def service_actions(self) -> None:
        super().service_actions()
        for connection in self.gate.late(time.monotonic()):
            self._close(connection, f"no request head within {self.gate.limits.head_s:g}s")

    def close_request(self, request: Any) -> None:
        self.gate.leave(request)
        super().close_request(request)

    def server_close(self) -> None:
        super().server_close()
        for connection in self.gate.drain():  # nothing sweeps them any more
            _end(connection)

    def handle_error(self, request: Any, client_address: Any) -> None:
        error = sys.exc_info()[1]
        if isinstance(error, OSError):
            # The peer broke off (a TLS handshake it failed, a refusal it did not read): its
            # doing, which a stranger may repeat at will, so rate-limited, without a trace.
            if self.gate.holds(request):  # else the gate closed it and said why
                why = f"it failed: {error}"
                self.limits_log.refused("a checkpoint-server connection", client_address, why)
            return
        logger.warning("checkpoint server: error serving %s", client_address, exc_info=True)


class _HeadReader:
    """A connection's ``rfile`` that counts the bytes of each request head against the limit."""

    def __init__(self, raw: BinaryIO, gate: Gate, key: Hashable) -> None:
        self._raw, self._gate, self._key = raw, gate, key
        self.used = 0  # bytes of the current head

    def readline(self, limit: int = -1) -> bytes:
        most = self._gate.limits.head_bytes
        room = most - self.used + 1  # one more than fits: a line that goes over says so
        line = self._raw.readline(room if limit < 0 else min(limit, room))
        self.used += len(line)
        if not self._gate.holds(self._key):
            raise HeadRefused(None)  # closed under the read: what came is not a request
        if self.used > most:
            raise HeadRefused(f"a request head over {most} bytes", answer=True)
        return line

    def close(self) -> None:
        self._raw.close()


class LimitedHandler(BaseHTTPRequestHandler):
    """The request handler's side of the limits: counts each head, reports where it stands."""

    server: LimitedServer
    rfile: Any  # a _HeadReader once set up

    def setup(self) -> None:
        super().setup()
        self.rfile = _HeadReader(self.rfile, self.server.gate, self.request)

    def handle(self) -> None:
        try:
            super().handle()
        except HeadRefused as e:
            self.close_connection = True
            if e.why is not None:
                self.server.limits_log.refused("a request head", self.client_address, e.why)
            if e.answer:
                body = e.why.encode() if e.why else b""
                head = "HTTP/1.1 431 Request Header Fields Too Large\r\nConnection: close\r\n"
                head += f"Content-Type: text/plain\r\nContent-Length: {len(body)}\r\n\r\n"
                try:
                    self.wfile.write(head.encode() + body)
                except OSError:
                    pass  # the peer is gone: nothing to tell

    def handle_one_request(self) -> None:
        if not self.server.gate.head_begins(self.request, time.monotonic()):
            raise HeadRefused(None)
        self.rfile.used = 0
        super().handle_one_request()

    def parse_request(self) -> bool:
        parsed = super().parse_request()
        if not self.server.gate.head_done(self.request):
            raise HeadRefused(None)  # closed before its head was complete: not answered
        return parsed
