"""A manager server's session on the lighthouse's direct TCP lane, on its asyncio loop.

:class:`DirectStream` carries one session (the group's own, not detached) to the lighthouse's
direct lane (``lighthouse/tcp.py``) and offers the few methods of a gRPC stream call that
``LighthouseLink`` uses (``write``, ``read``, ``done_writing``, ``cancel``), so the link speaks
the same protocol over either. Messages are length-delimited (``rpc/frames.py``).

Failures read as the link expects: a write on a broken connection raises
:class:`StreamClosed` (a ``RuntimeError``); a read returns ``grpc.aio.EOF`` once the
connection is over, whether the lighthouse closed it, the network broke it, or the lighthouse
ended the session with a ``SessionClosed`` event (its status is then :attr:`DirectStream.closed`).
The connection's end is what the lighthouse takes for this group's death, as with the stream.

The job token (``docs/security.md``): the link writes the same ``Hello`` on either lane; on
this one :meth:`DirectStream.write` puts the token in it (a gRPC stream carries it as call
metadata), so the link need not know which lane it speaks on.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

import grpc.aio
from google.protobuf.message import DecodeError, Message

from torchheal._base.security import SecurityEnv
from torchheal._wire import session_pb2 as spb
from torchheal.coordination.rpc.frames import FrameError, FrameReader, frame

__all__ = ["DirectStream", "StreamClosed"]

logger: logging.Logger = logging.getLogger(__name__)

# A quorum event carries every member of the job.
MAX_EVENT_BYTES = 256 * 1024 * 1024
# The most one read takes, into the connection's own buffer (a buffered protocol): asyncio's
# plain protocols read with recv(256 KiB), and allocating that much is an mmap/munmap pair per
# read (17-40 us measured here, more than the rest of handling an event).
READ_BYTES = 64 * 1024


class StreamClosed(RuntimeError):
    """The direct-lane connection is over; nothing more can be written."""


class _Protocol(asyncio.BufferedProtocol):
    def __init__(self) -> None:
        self._buffer = memoryview(bytearray(READ_BYTES))
        self.reader = FrameReader(MAX_EVENT_BYTES)
        self.events: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.transport: asyncio.Transport | None = None
        self.lost: Exception | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._buffer

    def buffer_updated(self, nbytes: int) -> None:
        try:
            messages = self.reader.feed(bytes(self._buffer[:nbytes]))
        except FrameError as e:
            logger.warning("the lighthouse sent a bad frame (%s); hanging up", e)
            assert self.transport is not None
            self.transport.abort()
            return
        for message in messages:
            self.events.put_nowait(message)

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = exc or ConnectionResetError("connection closed")
        self.events.put_nowait(None)


class DirectStream:
    """One session on the lighthouse's direct lane (use :meth:`open`)."""

    def __init__(
        self, transport: asyncio.Transport, protocol: _Protocol, token: str | None = None
    ) -> None:
        self._transport = transport
        self._protocol = protocol
        self._token = token
        self._cancelled = False
        #: The status the lighthouse ended the session with, if it said (``SessionClosed``).
        self.closed: spb.SessionClosed | None = None

    @classmethod
    async def open(
        cls, host: str, port: int, timeout_s: float, security: SecurityEnv | None = None
    ) -> DirectStream:
        """Connect to the lane at ``host:port``.

        Args:
            host: the lighthouse's host.
            port: its direct lane's port.
            timeout_s: how long connecting may take.
            security: the job token to send in the hello (default: read from the environment).

        Raises:
            ValueError: the security settings are malformed.
            OSError: the lane could not be reached within ``timeout_s`` (``TimeoutError``).
        """
        token = (SecurityEnv.from_env() if security is None else security).token
        loop = asyncio.get_running_loop()
        transport, protocol = await asyncio.wait_for(
            loop.create_connection(_Protocol, host, port), timeout_s
        )
        assert isinstance(transport, asyncio.Transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(transport, protocol, token)

    async def write(self, request: Message | bytes) -> None:
        """Send one ``SessionRequest``.

        Raises:
            StreamClosed: the connection is over.
        """
        if self._transport.is_closing():
            raise StreamClosed("the direct session is closed")
        if (
            self._token is not None
            and isinstance(request, spb.SessionRequest)
            and request.WhichOneof("kind") == "hello"
        ):
            stamped = spb.SessionRequest()
            stamped.CopyFrom(request)  # the caller's message stays as it was
            stamped.hello.token = self._token
            request = stamped
        data = request if isinstance(request, bytes) else request.SerializeToString()
        self._transport.write(frame(data))

    async def read(self) -> Any:
        """The next ``SessionEvent``, or ``grpc.aio.EOF`` once the session is over."""
        if self._protocol.lost is not None and self._protocol.events.empty():
            return grpc.aio.EOF
        message = await self._protocol.events.get()
        if message is None:
            self._protocol.events.put_nowait(None)  # later reads see the end too
            return grpc.aio.EOF
        try:
            event = spb.SessionEvent.FromString(message)
        except DecodeError as e:
            logger.warning("the lighthouse sent an event that does not parse (%s); hanging up", e)
            self.cancel()
            return grpc.aio.EOF
        if event.WhichOneof("kind") == "closed":
            self.closed = event.closed
            logger.warning(
                "the lighthouse ended the session: code %d: %s",
                event.closed.code,
                event.closed.message,
            )
            self.cancel()
            return grpc.aio.EOF
        return event

    async def done_writing(self) -> None:
        """Half-close: nothing more will be sent."""
        if not self._transport.is_closing() and self._transport.can_write_eof():
            self._transport.write_eof()

    def cancel(self) -> bool:
        """Hang up (what was written still leaves first: a goodbye is not lost)."""
        self._cancelled = True
        self._transport.close()
        return True

    def cancelled(self) -> bool:
        """Whether :meth:`cancel` ended it."""
        return self._cancelled
