"""The link's torchheal session: opening it (direct lane or gRPC stream), heartbeats, events.

A broken or *silent* session (a partition drops packets without a FIN or RST) is reopened with
backoff, on the next lighthouse of the list when there are several. The rules are
``session_client.py``'s; this module moves bytes and completes futures.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc
import grpc.aio

from torchheal._wire import session_pb2 as spb
from torchheal.coordination.group.dial import LinkError
from torchheal.coordination.group.link_tcp import DirectStream, StreamClosed
from torchheal.coordination.session_client import Answer, Ended, Lost, Refused, Welcomed
from torchheal.coordination.standing import limit_for

__all__ = ["SessionStream"]

logger: logging.Logger = logging.getLogger("torchheal.coordination.group.link")

# Reopening a broken session: first pause, growth, cap.
REOPEN_BACKOFF_S = (0.05, 2.0, 2.0)
# Asking the lighthouse what it offers, and reaching its direct lane.
DESCRIBE_TIMEOUT_S = 5.0
DIRECT_CONNECT_TIMEOUT_S = 5.0


class SessionStream:
    """The session half of :class:`~torchheal.coordination.group.link.LighthouseLink` (a mixin:
    its state is set by the link's constructor)."""

    async def _write(self, call: Any, request: bytes) -> None:
        if self._write_lock is None:
            self._write_lock = asyncio.Lock()
        async with self._write_lock:
            await call.write(request)

    async def _open_session(self) -> None:
        """Open the session (on the direct lane if the lighthouse has one that answers, else
        the gRPC stream), say hello, and wait for the welcome."""
        call: Any = await self._open_direct()
        self.direct = call is not None
        if call is None:
            call = self._open_stream()
        session = self._session
        loop = asyncio.get_running_loop()
        try:
            await self._write(call, session.hello(loop.time(), call.token if self.direct else ""))
            # A lighthouse that accepts but never welcomes must not hold the reopening forever.
            event = await asyncio.wait_for(call.read(), session.silent_s)
        except asyncio.TimeoutError:
            call.cancel()
            raise LinkError(
                grpc.StatusCode.UNAVAILABLE,
                f"the lighthouse session got no welcome within {session.silent_s:.1f}s",
            ) from None
        except StreamClosed as e:
            call.cancel()
            raise LinkError(grpc.StatusCode.UNAVAILABLE, str(e)) from None
        except grpc.aio.AioRpcError as e:
            # A write can fail before a reference lighthouse's HTTP 404 is read: the call's
            # final status is the true one (UNIMPLEMENTED).
            code, details = e.code(), e.details() or ""
            try:
                code, details = await call.code(), await call.details()
            except (grpc.aio.AioRpcError, asyncio.CancelledError):
                pass
            call.cancel()
            raise LinkError(code, details) from None
        said = None if event is grpc.aio.EOF else session.receive(event, loop.time())
        if not isinstance(said, Welcomed):
            call.cancel()
            if isinstance(said, Ended):  # the lighthouse said why (direct lane)
                raise LinkError(said.code, said.message)
            raise LinkError(grpc.StatusCode.INTERNAL, f"expected a welcome, got {event!r}")
        if session.heartbeat_timeout_s is not None:
            with self._standing_lock:
                self._standing.limit_s = limit_for(session.heartbeat_timeout_s, self._interval_s)
        self._call = call
        self._opened.set()

    async def _open_direct(self) -> DirectStream | None:
        """A connection to the lighthouse's direct lane; None: it has none, or it cannot be
        reached (the gRPC stream carries the session then). ``LinkError`` if it cannot be asked.

        The port is asked for at every (re)opening: a restarted lighthouse listens on a new one.
        """
        if self._host is None:
            return None
        try:
            description = await self._describe_call(
                spb.DescribeRequest(), timeout=DESCRIBE_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as e:
            raise LinkError(e.code(), e.details() or "") from None
        port = description.session_port
        if not port:
            return None
        try:
            return await DirectStream.open(
                self._host, port, DIRECT_CONNECT_TIMEOUT_S, self._security
            )
        except OSError as e:
            logger.warning(
                "%s the direct session lane of lighthouse %s (port %d) cannot be reached (%s); "
                "using its gRPC session stream",
                self._prefix,
                self._describe,
                port,
                e,
            )
            return None

    async def _run_session(self) -> None:
        backoff, growth, cap = REOPEN_BACKOFF_S
        pause = backoff
        failing = False
        while not self._closing:
            call = self._call
            if call is None:
                try:
                    await self._open_session()
                except LinkError as e:
                    if not failing:
                        logger.warning(
                            "%s cannot reopen the session with lighthouse %s: %s",
                            self._prefix,
                            self._describe,
                            e,
                        )
                        failing = True
                    if self._addresses:
                        try:
                            await self._fail_over()
                            continue  # at once: a fresh lighthouse is worth a try now
                        except LinkError:
                            pass
                    await asyncio.sleep(pause)
                    pause = min(cap, pause * growth)
                    continue
                if failing:
                    logger.info("%s lighthouse session is open again", self._prefix)
                    failing = False
                pause = backoff
                call = self._call
            heartbeats = asyncio.ensure_future(self._session_heartbeats(call))
            try:
                await self._read_events(call)
            finally:
                heartbeats.cancel()
            if self._closing:
                return
            logger.warning("%s lighthouse session with %s broke", self._prefix, self._describe)
            self._call = None
            self._opened.clear()
            why = "the lighthouse session broke"
            for future in self._session.end(why):
                if not future.done():
                    future.set_exception(LinkError(grpc.StatusCode.UNAVAILABLE, why))

    async def _session_heartbeats(self, call: Any) -> None:
        loop = asyncio.get_running_loop()
        session = self._session
        try:
            while True:
                silent_s = session.silence(loop.time())
                if silent_s is not None:
                    # A partition or a frozen lighthouse: a fresh connection gets through as
                    # soon as the network does, unlike this one's backed-off retransmissions.
                    logger.warning(
                        "%s the lighthouse session with %s has been silent for %.1fs; reopening it",
                        self._prefix,
                        self._describe,
                        silent_s,
                    )
                    call.cancel()  # the reader sees the end and reopens
                    return
                await self._write(call, session.heartbeat(loop.time()))
                await asyncio.sleep(min(self._interval_s, session.silent_s / 4))
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, RuntimeError):
            call.cancel()  # the reader sees the end and reopens

    async def _read_events(self, call: Any) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                event = await call.read()
            except (grpc.aio.AioRpcError, asyncio.CancelledError) as e:
                if isinstance(e, asyncio.CancelledError) and not call.cancelled():
                    raise
                return
            if event is grpc.aio.EOF:
                return
            said = self._session.receive(event, loop.time())
            if isinstance(said, Answer) and not said.waiter.done():
                if isinstance(said.value, Refused):
                    said.waiter.set_exception(LinkError(said.value.code, said.value.message))
                else:
                    said.waiter.set_result(said.value)
            elif isinstance(said, Lost):
                if said.ours:
                    self._dropped(said.notice)
                try:
                    self._on_lost(said.notice)
                except Exception:
                    logger.exception("%s handling a lost-member notice failed", self._prefix)
            elif isinstance(said, Ended):
                logger.warning("%s %s; hanging up", self._prefix, said.reason)
                call.cancel()
                return
