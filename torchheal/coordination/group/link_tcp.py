"""A manager server's session on the lighthouse's direct TCP lane, on its asyncio loop.

:class:`DirectStream` offers the few methods of a gRPC stream call that ``LighthouseLink`` uses
(``write``, ``read``, ``done_writing``, ``cancel``), so the link speaks the same protocol over
either, length-delimited here (``rpc/frames.py``). A write on a broken connection raises
:class:`StreamClosed`; a read returns ``grpc.aio.EOF``. The job token travels in the hello.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

import grpc.aio

from torchheal._base.security import SecurityEnv
from torchheal.coordination.rpc.frames import FrameError, FrameReader, frame
from torchheal.coordination.session_client import MAX_EVENT_BYTES

__all__ = ["DirectStream", "StreamClosed"]

logger: logging.Logger = logging.getLogger(__name__)

# The most one read takes, into the connection's own buffer: a large fresh allocation per read
# is an mmap/munmap pair.
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
        #: The job token, for the hello (``""``: none).
        self.token = token or ""
        self._cancelled = False

    @classmethod
    async def open(
        cls, host: str, port: int, timeout_s: float, security: SecurityEnv
    ) -> DirectStream:
        """Connect to the lane at ``host:port``; ``OSError`` (``TimeoutError`` too) if it cannot
        be reached within ``timeout_s``."""
        token = security.token
        loop = asyncio.get_running_loop()
        transport, protocol = await asyncio.wait_for(
            loop.create_connection(_Protocol, host, port), timeout_s
        )
        assert isinstance(transport, asyncio.Transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(transport, protocol, token)

    async def write(self, request: bytes) -> None:
        """Send one serialized ``SessionRequest`` (:class:`StreamClosed` once it is over)."""
        if self._transport.is_closing():
            raise StreamClosed("the direct session is closed")
        self._transport.write(frame(request))

    async def read(self) -> Any:
        """The next serialized ``SessionEvent``, or ``grpc.aio.EOF`` once the session is over."""
        if self._protocol.lost is not None and self._protocol.events.empty():
            return grpc.aio.EOF
        message = await self._protocol.events.get()
        if message is None:
            self._protocol.events.put_nowait(None)  # later reads see the end too
            return grpc.aio.EOF
        return message

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
