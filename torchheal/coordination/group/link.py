"""A manager server's link to the lighthouse: a torchheal session, or the reference's unary calls.

With a torchheal lighthouse the link is one long-lived session (``session.proto``): heartbeats
and requests go up, quorums and ``MemberLost`` notices come down, and if this process dies the
session's end tells the lighthouse at once. A reference lighthouse answers ``UNIMPLEMENTED``; the
link then speaks its unary calls (``link_unary.py``). A request in flight when the session breaks
fails with ``UNAVAILABLE``. Runs on the manager server's event loop; parts in ``link_*.py``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import grpc.aio

from torchheal._base.manager_timeouts import DEFAULT_LIGHTHOUSE_HEARTBEAT_TIMEOUT
from torchheal._base.security import SecurityEnv
from torchheal._wire import methods
from torchheal._wire import session_pb2 as spb
from torchheal._wire import torchft_pb2 as pb
from torchheal.coordination.group.dial import LinkError
from torchheal.coordination.group.link_session import SessionStream
from torchheal.coordination.group.link_standing import StandingWatch
from torchheal.coordination.group.link_tcp import StreamClosed
from torchheal.coordination.group.link_unary import HEARTBEAT_CALL_TIMEOUT_S, UnaryLink
from torchheal.coordination.rpc.addresses import parse_address
from torchheal.coordination.rpc.channels import aio_connect, serialize
from torchheal.coordination.session_client import SILENT_SESSION_S, SessionClient
from torchheal.coordination.standing import Standing, limit_for

__all__ = ["LighthouseLink"]

logger: logging.Logger = logging.getLogger("torchheal.coordination.group.link")

#: How long a quorum request waits for a reopening session before it fails (and is asked again).
REOPEN_WAIT_S = 1.0

# Reaching another lighthouse of the list (a standby that became the leader).
FAILOVER_CONNECT_TIMEOUT_S = 1.0


class LighthouseLink(SessionStream, StandingWatch, UnaryLink):
    """The connection of one replica group's manager server to the lighthouse.

    Args:
        channel: an open asyncio channel to the lighthouse.
        replica_id: the group's full id.
        heartbeat_interval_s: pause between heartbeats.
        on_lost: called (on the loop) with each ``MemberLost`` notice the lighthouse sends.
        describe: names the lighthouse in log lines.
        log_prefix: prefixes log lines (``[Replica name]``).
        host: the lighthouse's host, where its direct lane listens (None: the gRPC stream only).
        addresses: every lighthouse of a highly available job (empty: one); a session that
            cannot be (re)opened moves on to the next.
        silent_s: a session silent this long is hung up and reopened.
        last_quorum_id: the last quorum id of an earlier process of this group (0: none).
        security: the job token and TLS settings of every connection it opens.
    """

    def __init__(
        self,
        channel: grpc.aio.Channel,
        replica_id: str,
        heartbeat_interval_s: float,
        on_lost: Callable[[spb.MemberLost], None],
        describe: str,
        log_prefix: str,
        host: str | None = None,
        addresses: Sequence[str] = (),
        silent_s: float = SILENT_SESSION_S,
        last_quorum_id: int = 0,
        *,
        security: SecurityEnv,
    ) -> None:
        # The session's protocol state, kept across reopenings and fail-overs (its last quorum,
        # the history the group holds, its pending requests); loop thread only.
        self._session: SessionClient[asyncio.Future[pb.Quorum]] = SessionClient(
            replica_id, silent_s=silent_s, last_quorum_id=last_quorum_id
        )
        self._interval_s = heartbeat_interval_s
        self._security = security
        # Judged by the default heartbeat timeout until a welcome tells the lighthouse's own;
        # read from the thread that decides a commit vote, hence the lock.
        self._standing = Standing(
            limit_for(DEFAULT_LIGHTHOUSE_HEARTBEAT_TIMEOUT.total_seconds(), heartbeat_interval_s),
            time.monotonic(),
        )
        self._standing_lock = threading.Lock()
        self._on_lost = on_lost
        self._prefix = log_prefix
        self._addresses = list(addresses) if len(addresses) > 1 else []
        # Channels this link opened itself (to other lighthouses); closed with it.
        self._own_channels: list[grpc.aio.Channel] = []
        self._bind(channel, describe, host)
        #: Whether the live session travels on the direct TCP lane (else the gRPC stream).
        self.direct = False
        # None until start() knows; then True (session) or False (reference lighthouse).
        self.session_mode: bool | None = None
        self._call: Any = None  # the live session stream, or None while it is (re)opening
        self._opened = asyncio.Event()  # set while there is a live session
        self._closing = False
        # One writer at a time on the stream (heartbeats and requests share it).
        self._write_lock: asyncio.Lock | None = None

    @property
    def joined_running(self) -> bool:
        """The job was already running when our first session opened (see group/server.py)."""
        return bool(self._session.joined_running)

    def _bind(self, channel: grpc.aio.Channel, describe: str, host: str | None) -> None:
        """Talk to the lighthouse behind ``channel`` from now on."""
        self._channel = channel
        self._describe = describe
        self._host = host

        def unary(method: methods.Method) -> Any:
            return channel.unary_unary(
                method.path,
                request_serializer=serialize,
                response_deserializer=method.response.FromString,
            )

        self._unary_quorum = unary(methods.LIGHTHOUSE_QUORUM)
        self._unary_heartbeat = unary(methods.LIGHTHOUSE_HEARTBEAT)
        self._describe_call = unary(methods.LIGHTHOUSE_DESCRIBE)
        # Bytes both ways: the session core builds and reads the session's messages.
        self._open_stream = channel.stream_stream(methods.LIGHTHOUSE_SESSION.path)

    async def _fail_over(self) -> None:
        """Move on to the next lighthouse of the list (a standby may lead now); ``LinkError`` if
        it cannot be reached (the next attempt tries the one after)."""
        addresses = self._addresses
        index = addresses.index(self._describe) if self._describe in addresses else -1
        target = addresses[(index + 1) % len(addresses)]
        try:
            channel = await aio_connect(target, FAILOVER_CONNECT_TIMEOUT_S, self._security)
        except RuntimeError as e:
            # Remember where we are, so the next attempt moves past this one too.
            self._describe = target
            raise LinkError(grpc.StatusCode.UNAVAILABLE, str(e)) from None
        logger.warning("%s failing over to lighthouse %s", self._prefix, target)
        old = self._channel
        self._bind(channel, target, parse_address(target)[0])
        if old in self._own_channels:
            self._own_channels.remove(old)
            await old.close()
        self._own_channels.append(channel)

    # ------------------------------------------------------------------------------------------
    # Life cycle

    async def start(self) -> None:
        """Open the session, or learn that the lighthouse only speaks the reference's protocol
        (``LinkError`` if it answers neither a session nor a unary heartbeat)."""
        error: LinkError | None = None
        for _ in range(max(2, 2 * len(self._addresses))):
            try:
                await self._open_session()
                self.session_mode = True
                return
            except LinkError as e:
                error = e
                if e.code == grpc.StatusCode.UNIMPLEMENTED:
                    break
                if self._addresses:
                    # Several lighthouses: only torchheal ones, in sessions; try the next.
                    try:
                        await self._fail_over()
                    except LinkError as failed:
                        error = failed
                    continue
                # A reference lighthouse answers the unknown method with HTTP 404 and closes;
                # when that races our first write the call ends INTERNAL instead: try again.
                await asyncio.sleep(0.05)
        if error is not None and error.code != grpc.StatusCode.UNIMPLEMENTED:
            # Not a clear "unknown method": serve in the reference's way only if it answers so.
            try:
                await self._unary_heartbeat(
                    pb.LighthouseHeartbeatRequest(replica_id=self._session.label),
                    timeout=HEARTBEAT_CALL_TIMEOUT_S,
                )
            except grpc.aio.AioRpcError:
                raise error from None
            logger.warning(
                "%s lighthouse %s refused a session (%s) but answers heartbeats",
                self._prefix,
                self._describe,
                error,
            )
        self.session_mode = False
        logger.info(
            "%s lighthouse %s has no torchheal session (a reference lighthouse?): using its "
            "unary Heartbeat/Quorum; a dead group is then noticed only when its heartbeat "
            "expires",
            self._prefix,
            self._describe,
        )

    async def run(self) -> None:
        """Heartbeat forever; in session mode also read events and reopen a broken session."""
        ticks = asyncio.ensure_future(self._tick())
        try:
            if self.session_mode:
                await self._run_session()
            else:
                await self._run_unary_heartbeats()
        finally:
            ticks.cancel()

    async def close(self, reason: str = "shutdown") -> None:
        """Say goodbye (the lighthouse lets the others go on without us at once) and hang up."""
        self._closing = True
        call = self._call
        self._call = None
        self._opened.clear()
        if call is not None:
            try:
                await self._write(call, self._session.goodbye(reason))
                await call.done_writing()
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError, RuntimeError):
                pass
            call.cancel()
        await self._close_own_channels()

    async def _close_own_channels(self) -> None:
        channels, self._own_channels = self._own_channels, []
        for channel in channels:
            await channel.close()

    # ------------------------------------------------------------------------------------------
    # Quorum

    async def quorum(self, requester: pb.QuorumMember, timeout_s: float) -> pb.Quorum:
        """Ask the lighthouse for the next quorum on behalf of the group (``LinkError`` if it
        refused, the call timed out, or the session broke)."""
        with self._standing_lock:
            self._standing.asked()
        self._session.asked()
        if not self.session_mode:
            return await self._unary_quorum_call(requester, timeout_s)
        call = self._call
        if call is None and not self._closing:
            # A broken session is reopened at once, in milliseconds when the lighthouse is up:
            # wait for that rather than fail and be asked again a retry later.
            try:
                await asyncio.wait_for(self._opened.wait(), min(timeout_s, REOPEN_WAIT_S))
            except asyncio.TimeoutError:
                pass
            call = self._call
        if call is None:
            raise LinkError(grpc.StatusCode.UNAVAILABLE, "the lighthouse session is reopening")
        future: asyncio.Future[pb.Quorum] = asyncio.get_running_loop().create_future()
        request_id, request = self._session.quorum_request(requester, timeout_s, future)
        try:
            await self._write(call, request)
            # The lighthouse answers a timed-out request itself; our timer is the backstop.
            quorum = await asyncio.wait_for(asyncio.shield(future), timeout_s + 1.0)
            with self._standing_lock:
                self._standing.received()
            return quorum
        except asyncio.TimeoutError:
            raise LinkError(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"no quorum within {timeout_s:.3f}s", local=True
            ) from None
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, RuntimeError) as e:
            raise LinkError(
                grpc.StatusCode.UNAVAILABLE, f"the lighthouse session broke: {e}"
            ) from None
        finally:
            self._session.withdraw(request_id)

    async def gave_up(self, quorum_id: int, reason: str) -> bool:
        """Tell the lighthouse that the group gave up building quorum ``quorum_id``'s process
        group (``GaveUp``), so that it tells the other groups waiting in that build.

        Best effort, returning whether it was sent: not without a live session, or to a
        lighthouse older than session protocol 2 (which would end the session).
        """
        call = self._call
        request = self._session.gave_up(quorum_id, reason)
        if not self.session_mode or call is None or request is None:
            return False
        try:
            await self._write(call, request)
        except (grpc.aio.AioRpcError, StreamClosed, RuntimeError) as e:
            logger.info(
                "%s could not tell the lighthouse of the given-up build: %s", self._prefix, e
            )
            return False
        return True
