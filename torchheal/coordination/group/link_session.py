"""The link's torchheal session: opening it (direct lane or gRPC stream), heartbeats, events.

The session travels on the lighthouse's direct TCP lane when it announces one
(``LighthouseSession/Describe``; ``link_tcp.py``), and on the
``torchheal.LighthouseSession/Session`` gRPC stream when the lane cannot be reached. A broken
session is reopened with backoff, on the next lighthouse of the list when there are several; a
session that went *silent* (a partition drops packets without a FIN or RST) counts as broken
too: a heartbeat asks for an acknowledgement once the lighthouse has said nothing for a while,
and a session silent for :data:`SILENT_SESSION_S` is hung up and reopened.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any

import grpc
import grpc.aio

from torchheal._wire import methods
from torchheal._wire import session_pb2 as spb
from torchheal._wire import torchft_pb2 as pb
from torchheal.coordination.group.dial import LinkError, status_code
from torchheal.coordination.group.link_tcp import DirectStream, StreamClosed
from torchheal.coordination.standing import limit_for

__all__ = ["SILENT_SESSION_S", "SessionStream"]

logger: logging.Logger = logging.getLogger("torchheal.coordination.group.link")

# Reopening a broken session: first pause, growth, cap.
REOPEN_BACKOFF_S = (0.05, 2.0, 2.0)
# Asking the lighthouse what it offers, and reaching its direct lane.
DESCRIBE_TIMEOUT_S = 5.0
DIRECT_CONNECT_TIMEOUT_S = 5.0
# A session that has carried no event (answer, notice, heartbeat acknowledgement) for this long
# is taken for dead and reopened: the reference's heartbeat timeout, after which the lighthouse
# has given the group up anyway. Heartbeats ask for an acknowledgement after a quarter of it.
SILENT_SESSION_S = 5.0


class SessionStream:
    """The session half of :class:`~torchheal.coordination.group.link.LighthouseLink` (a mixin:
    its state is set by the link's constructor)."""

    async def _write(self, call: Any, request: spb.SessionRequest) -> None:
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
        try:
            await self._write(
                call,
                spb.SessionRequest(
                    hello=spb.Hello(
                        replica_id=self._replica_id,
                        protocol=methods.SESSION_PROTOCOL,
                        last_quorum=self._last_quorum,
                    )
                ),
            )
            # A lighthouse that accepts the connection but never welcomes us (the path
            # stalled again) must not hold the reopening forever.
            event = await asyncio.wait_for(call.read(), self._silent_s)
        except asyncio.TimeoutError:
            call.cancel()
            raise LinkError(
                grpc.StatusCode.UNAVAILABLE,
                f"the lighthouse session got no welcome within {self._silent_s:.1f}s",
            ) from None
        except StreamClosed as e:
            call.cancel()
            raise LinkError(grpc.StatusCode.UNAVAILABLE, str(e)) from None
        except grpc.aio.AioRpcError as e:
            # A write can fail before the server's answer is read (a reference lighthouse
            # answers an unknown method with HTTP 404 and closes): the call's final status is
            # the true one (UNIMPLEMENTED).
            code, details = e.code(), e.details() or ""
            try:
                code, details = await call.code(), await call.details()
            except (grpc.aio.AioRpcError, asyncio.CancelledError):
                pass
            call.cancel()
            raise LinkError(code, details) from None
        if event is grpc.aio.EOF and getattr(call, "closed", None) is not None:
            closed = call.closed  # the lighthouse said why (direct lane)
            raise LinkError(status_code(closed.code), closed.message)
        if event is grpc.aio.EOF or event.WhichOneof("kind") != "welcome":
            call.cancel()
            raise LinkError(grpc.StatusCode.INTERNAL, f"expected a welcome, got {event!r}")
        self._protocol = event.welcome.protocol
        if self.first_welcome_quorum_id is None:
            self.first_welcome_quorum_id = event.welcome.quorum_id
            # Any id: the job was running, or restarted with its groups, which then each warm
            # up one step too (the id a restarted group reports is adopted before the welcome,
            # and a job whose peers have not yet formed their next quorum says the same).
            self.joined_running = event.welcome.quorum_id > 0
        if event.welcome.heartbeat_timeout_ms > 0:
            with self._standing_lock:
                self._standing.limit_s = limit_for(
                    event.welcome.heartbeat_timeout_ms / 1000.0, self._interval_s
                )
        self._heard_at = asyncio.get_running_loop().time()
        self._call = call
        self._opened.set()

    async def _open_direct(self) -> DirectStream | None:
        """A connection to the lighthouse's direct lane; None: it has none, or it cannot be
        reached (the gRPC stream carries the session then).

        The lane's port is asked for at every (re)opening: a restarted lighthouse listens on
        a new one.

        Raises:
            LinkError: ``UNIMPLEMENTED`` from a reference lighthouse; the status of a
                lighthouse that cannot be asked.
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
            return await DirectStream.open(self._host, port, DIRECT_CONNECT_TIMEOUT_S)
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
            self._fail_pending("the lighthouse session broke")

    async def _session_heartbeats(self, call: Any) -> None:
        beat = spb.SessionRequest(heartbeat=spb.Heartbeat())
        loop = asyncio.get_running_loop()
        acks = itertools.count(1)
        try:
            while True:
                silent_s = loop.time() - self._heard_at
                if silent_s >= self._silent_s:
                    # No FIN, no RST, no answer: a partition (or a frozen lighthouse). The
                    # lighthouse has given this group up by now; a fresh connection gets
                    # through as soon as the network does, unlike this one's backed-off
                    # retransmissions.
                    logger.warning(
                        "%s the lighthouse session with %s has been silent for %.1fs; reopening it",
                        self._prefix,
                        self._describe,
                        silent_s,
                    )
                    call.cancel()  # the reader sees the end and reopens
                    return
                if silent_s >= self._silent_s / 4:
                    # Quiet for a while (no quorum round in flight): ask for a sign of life.
                    await self._write(
                        call, spb.SessionRequest(heartbeat=spb.Heartbeat(ack=next(acks)))
                    )
                else:
                    await self._write(call, beat)
                await asyncio.sleep(min(self._interval_s, self._silent_s / 4))
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, RuntimeError):
            call.cancel()  # the reader sees the end and reopens

    async def _read_events(self, call: Any) -> None:
        while True:
            try:
                event = await call.read()
            except (grpc.aio.AioRpcError, asyncio.CancelledError) as e:
                if isinstance(e, asyncio.CancelledError) and not call.cancelled():
                    raise
                return
            if event is grpc.aio.EOF:
                return
            self._heard_at = asyncio.get_running_loop().time()
            kind = event.WhichOneof("kind")
            if kind == "quorum":
                self._settle(event.quorum.request_id, result=event.quorum.quorum)
            elif kind == "failed":
                failed = event.failed
                code = status_code(failed.code)
                self._settle(failed.request_id, error=LinkError(code, failed.message))
            elif kind == "lost":
                if event.lost.replica_id == self._replica_id:
                    self._dropped(event.lost)
                try:
                    self._on_lost(event.lost)
                except Exception:
                    logger.exception("%s handling a lost-member notice failed", self._prefix)

    def _settle(
        self, request_id: int, result: pb.Quorum | None = None, error: LinkError | None = None
    ) -> None:
        future = self._pending.get(request_id)
        if future is None or future.done():
            return  # an answer to a request nobody waits for any more
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def _fail_pending(self, why: str) -> None:
        for future in self._pending.values():
            if not future.done():
                future.set_exception(LinkError(grpc.StatusCode.UNAVAILABLE, why))
