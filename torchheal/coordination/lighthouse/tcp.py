"""The lighthouse's direct session lane: torchheal sessions on a plain TCP connection.

The gRPC session stream's messages, length-prefixed (``rpc/frames.py``), on a port announced by
``LighthouseSession/Describe``: gRPC's Python stack costs far more CPU per message, and the
lighthouse answers every group every step. The connection's end is the session's end; TCP
keep-alive ends one whose peer vanished within about the heartbeat timeout. A session that breaks
the protocol is told why (``SessionClosed``) and disconnected.

With a job token the first message must be a ``Hello`` carrying it (else ``UNAUTHENTICATED``);
with TLS on the lane is not opened. Until its ``Hello`` lets it in a connection is a stranger's,
and what strangers can make the lighthouse hold is bounded (:class:`LaneLimits`).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from torchheal._base.security import SecurityEnv
from torchheal._wire import session_pb2 as spb
from torchheal._wire.splice import varint
from torchheal.coordination.lighthouse.session import SessionProtocol
from torchheal.coordination.rpc.auth import RefusalLog, token_matches
from torchheal.coordination.rpc.errors import StatusError
from torchheal.coordination.rpc.frames import DEFAULT_MAX_FRAME, FrameError, FrameReader

__all__ = ["LIMITS", "MAX_UNSENT_BYTES", "DirectLane", "LaneLimits", "set_keepalive"]

# A child of the lighthouse's logger, so configuring that one configures the whole lighthouse.
logger: logging.Logger = logging.getLogger("torchheal.coordination.lighthouse.tcp")

#: A peer that leaves this much unread is not reading at all: it is disconnected.
MAX_UNSENT_BYTES = 256 * 1024 * 1024
#: How long a session the lighthouse ended may take to read why and close its side.
LINGER_S = 5.0
#: The most one read takes; reads land in one buffer per lane (a fresh one would be an
#: ``mmap``/``munmap`` pair per read).
READ_BYTES = 256 * 1024


@dataclass(frozen=True)
class LaneLimits:
    """What connections may hold before their ``Hello`` has let them in.

    Args:
        hello_bytes: the largest first frame (a ``Hello`` of 8,000 groups' last quorum fits).
        hello_s: how long after connecting the ``Hello`` must be complete.
        waiting: the most connections not let in (ended ones until they close); the oldest is
            closed to make room.
        waiting_bytes: the most their unfinished hellos may hold together.
    """

    hello_bytes: int = 1024 * 1024
    hello_s: float = 10.0
    waiting: int = 1024
    waiting_bytes: int = 32 * 1024 * 1024


#: The limits a lane is made with unless told others.
LIMITS = LaneLimits()


class _Strangers:
    """A lane's connections not let in yet (oldest first), and what their hellos hold."""

    __slots__ = ("held", "waiting")

    def __init__(self) -> None:
        self.waiting: dict[_Connection, None] = {}  # an ordered set
        self.held = 0


def set_keepalive(sock: socket.socket, after_s: float) -> None:
    """Make the kernel end a connection whose peer stopped answering after about ``after_s``
    (probes from ``after_s / 2``, three over the other half; plain keep-alive off Linux)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle = max(1, int(after_s / 2))
    interval = max(1, int(after_s / 6))
    for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval), ("TCP_KEEPCNT", 3)):
        option = getattr(socket, name, None)
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)


class _Peer:
    """Writes a session's events on its connection."""

    __slots__ = ("_transport",)

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport

    def send(self, event: bytes) -> None:
        transport = self._transport
        if transport.is_closing():
            return
        transport.write(varint(len(event)) + event)
        if transport.get_write_buffer_size() > MAX_UNSENT_BYTES:
            logger.warning("a session does not read its events; disconnecting it")
            transport.abort()


class _Connection(asyncio.BufferedProtocol):
    """One direct-lane connection: frames in, session events out.

    ``buffer`` is shared by the lane's connections: asyncio fills it and calls
    :meth:`buffer_updated` at once, on the loop thread.
    """

    def __init__(
        self,
        lighthouse: Any,
        keepalive_s: float,
        live: set[_Connection],
        token: str | None,
        refusals: RefusalLog,
        buffer: memoryview,
        limits: LaneLimits,
        strangers: _Strangers,
        crowded: RefusalLog,
    ) -> None:
        self._buffer = buffer
        self._lighthouse = lighthouse
        self._keepalive_s = keepalive_s
        self._live = live
        self._token = token  # None once the hello proved it (or when there is none)
        self._refusals = refusals
        self._limits = limits
        self._strangers = strangers
        self._crowded = crowded
        self._reader = FrameReader(DEFAULT_MAX_FRAME, limits.hello_bytes)
        self._transport: asyncio.Transport | None = None
        self._session: SessionProtocol | None = None
        self._over = False
        self._linger: asyncio.TimerHandle | None = None
        # Counted in ``strangers`` until the Hello is handled (or the connection is lost).
        self._stranger = False
        self._held = 0  # this connection's part of ``strangers.held``
        self._hello_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        self._live.add(self)
        strangers = self._strangers
        if len(strangers.waiting) >= self._limits.waiting:
            # The oldest makes room: a group greets within moments of connecting, so a crowd
            # cannot keep it out unless renewed faster than that.
            oldest = next(iter(strangers.waiting))
            why = f"{len(strangers.waiting)} connections were waiting for their hello"
            self._crowded.refused("the oldest direct-lane connection", oldest._peername(), why)
            oldest._evict()
        strangers.waiting[self] = None
        self._stranger = True
        loop = asyncio.get_running_loop()
        self._hello_timer = loop.call_later(self._limits.hello_s, self._no_hello)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                set_keepalive(sock, self._keepalive_s)
            except OSError as e:  # a socket that cannot take options still works
                logger.debug("direct lane: socket options: %s", e)
        self._session = SessionProtocol(self._lighthouse, _Peer(transport))

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._buffer

    def buffer_updated(self, nbytes: int) -> None:
        if self._over:
            return
        session = self._session
        assert session is not None
        try:
            for message in self._reader.feed(bytes(self._buffer[:nbytes])):
                if self._token is not None:
                    self._admit(message)
                if not session.handle(message):
                    self._end(None)  # goodbye
                    return
                if self._stranger:
                    self._no_longer_stranger()
            if self._stranger:
                self._hold(self._reader.pending)
            # Everything this read carried has joined: decide now if a round may be complete.
            self._lighthouse.decide_if_due()
        except FrameError as e:
            self._end(StatusError(grpc.StatusCode.INVALID_ARGUMENT, str(e)))
        except StatusError as e:
            self._end(e)
        except Exception as e:  # a bug of ours must not take the lighthouse down
            logger.exception("direct lane: handling a session request failed")
            self._end(StatusError(grpc.StatusCode.INTERNAL, f"session request failed: {e}"))

    def _admit(self, message: bytes) -> None:
        """Check the job token in the session's first message (``UNAUTHENTICATED`` if not)."""
        assert self._token is not None
        try:
            request = spb.SessionRequest.FromString(message)
        except DecodeError:
            request = spb.SessionRequest()
        given = request.hello.token if request.WhichOneof("kind") == "hello" else ""
        if not token_matches(given, self._token):
            why = "wrong job token" if given else "no job token"
            raise StatusError(
                grpc.StatusCode.UNAUTHENTICATED,
                f"{why}: this lighthouse requires the job token (TORCHHEAL_TOKEN) in the hello",
            )
        self._token = None

    def _hold(self, pending: int) -> None:
        """Count what this stranger's unfinished hello holds (``RESOURCE_EXHAUSTED`` if the
        lane's strangers hold too much)."""
        strangers = self._strangers
        strangers.held += pending - self._held
        self._held = pending
        if strangers.held > self._limits.waiting_bytes:
            raise StatusError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"unfinished hellos hold over {self._limits.waiting_bytes} bytes on this lane",
            )

    def _let_go(self) -> None:
        """Stop counting what this stranger holds, and stop its hello's clock."""
        self._strangers.held -= self._held
        self._held = 0
        if self._hello_timer is not None:
            self._hello_timer.cancel()
            self._hello_timer = None

    def _no_longer_stranger(self) -> None:
        """Leave the lane's strangers: let in (the Hello is handled), or gone."""
        self._let_go()
        del self._strangers.waiting[self]
        self._stranger = False

    def _evict(self) -> None:
        """Close at once, dropping what was received, to make room for a newer stranger."""
        self._no_longer_stranger()
        self._over = True
        self._reader = FrameReader(0)
        self.abort()

    def _no_hello(self) -> None:
        self._hello_timer = None
        if not self._over:
            self._end(
                StatusError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"no hello within {self._limits.hello_s:g}s of connecting",
                )
            )

    def _peername(self) -> Any:
        assert self._transport is not None
        return self._transport.get_extra_info("peername")

    def eof_received(self) -> bool:
        return False  # the peer is done: close our side too

    def _end(self, error: StatusError | None) -> None:
        self._over = True
        transport = self._transport
        assert transport is not None and self._session is not None
        self._reader = FrameReader(0)  # what was left unread is dropped (nothing more is read)
        if self._stranger:
            # It keeps its place among the strangers until it closes (lingering ones count
            # too); what it held is let go now.
            self._let_go()
        if error is not None:
            if self._stranger:  # strangers come by the thousand: rate-limited lines
                self._refusals.refused("a direct-lane connection", self._peername(), str(error))
            else:
                replica_id = self._session.replica_id or "(no hello)"
                logger.info("ending session of %s: %s", replica_id, error)
            event = spb.SessionEvent(
                closed=spb.SessionClosed(code=error.code.value[0], message=error.details)
            ).SerializeToString()
            transport.write(varint(len(event)) + event)
            if transport.can_write_eof():
                # Half-close and drop what still comes: closing with unread bytes sends a
                # reset, which can reach the peer before it reads why. The peer's own close,
                # or LINGER_S, ends the connection.
                transport.write_eof()
                self._linger = asyncio.get_running_loop().call_later(LINGER_S, transport.abort)
                self._close_session()  # the session is over now, not when the peer closes
                return
        transport.close()  # after what is buffered has been sent

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self._over = True
        if self._linger is not None:
            self._linger.cancel()
        if self._stranger:
            self._no_longer_stranger()
        self._live.discard(self)
        self._close_session()

    def _close_session(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            session.close()


def _listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host:port`` (``::``: every address, IPv4 too)."""
    if host in ("", "::", "0.0.0.0"):
        family = socket.AF_INET6 if host != "0.0.0.0" and socket.has_ipv6 else socket.AF_INET
        address: tuple[Any, ...] = ("::" if family == socket.AF_INET6 else "0.0.0.0", port)
    else:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, address = info[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and host in ("", "::"):
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(address)
        sock.listen(1024)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


class DirectLane:
    """The direct session lane of one lighthouse: a listening socket and its connections.

    With TLS on, :meth:`start` opens nothing and :attr:`port` stays 0.
    """

    def __init__(
        self,
        lighthouse: Any,
        keepalive_s: float,
        security: SecurityEnv,
        limits: LaneLimits | None = None,
    ) -> None:
        self._lighthouse = lighthouse
        self._keepalive_s = keepalive_s
        self._security = security
        self._refusals = RefusalLog(logger)
        self._crowded = RefusalLog(logger)  # apart: a crowd must not hide why others failed
        self._limits = LIMITS if limits is None else limits
        self._strangers = _Strangers()
        self._buffer = memoryview(bytearray(READ_BYTES))
        self._live: set[_Connection] = set()
        self._server: asyncio.AbstractServer | None = None
        self.port = 0

    async def start(self, host: str, port: int) -> None:
        """Listen on ``host:port`` (port 0: any free port; ``::``: every address)."""
        if self._security.tls:
            # The lane is plain TCP: with TLS on, sessions take the (encrypted) gRPC stream.
            logger.info("TLS is on: no direct session lane; sessions use the gRPC stream")
            return
        sock = _listening_socket(host, port)
        token = self._security.token
        try:
            self._server = await asyncio.get_running_loop().create_server(
                lambda: _Connection(
                    self._lighthouse,
                    self._keepalive_s,
                    self._live,
                    token,
                    self._refusals,
                    self._buffer,
                    self._limits,
                    self._strangers,
                    self._crowded,
                ),
                sock=sock,
            )
        except BaseException:
            sock.close()
            raise
        self.port = sock.getsockname()[1]

    def close(self) -> None:
        """Stop listening and drop every connection (their sessions end)."""
        if self._server is not None:
            self._server.close()
        for connection in list(self._live):
            connection.abort()
