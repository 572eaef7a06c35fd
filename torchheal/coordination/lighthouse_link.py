"""A manager server's link to the lighthouse: a torchheal session, or the reference's unary calls.

With a torchheal lighthouse the link is one long-lived session (``session.proto``): heartbeats
and quorum requests go up it, quorums and ``MemberLost`` notices come down, and if this process
dies the session's end tells the lighthouse at once. The session travels on the lighthouse's
direct TCP lane when it announces one (``LighthouseSession/Describe``; ``link_tcp.py``), which
costs both sides a fraction of a gRPC stream message, and on the
``torchheal.LighthouseSession/Session`` gRPC stream when the lane cannot be reached. A reference
lighthouse serves neither (it answers ``UNIMPLEMENTED``); the link then speaks the reference's
unary ``Heartbeat``/``Quorum``, exactly as a torchft manager would.

A broken session (the lighthouse restarted, the network failed) is reopened in the background,
with backoff; a quorum request in flight when it broke fails with ``UNAVAILABLE`` and the
manager server's retry policy decides what happens next. A session that went *silent* counts as
broken too: a partition drops packets without a FIN or RST, and after a long one TCP's
retransmission backoff can keep the old connection mute for as long again after the network is
back. So a heartbeat asks the lighthouse for an acknowledgement once it has said nothing for a
while, and a session that has said nothing for :data:`SILENT_SESSION_S` is hung up and reopened
on a fresh connection. Everything here runs on the manager server's event loop.

Several lighthouses (a highly available job, docs/lighthouse_ha.md): the address may list them,
comma-separated (``split_addresses``); :func:`connect_first` connects to the first that answers,
and a session that cannot be reopened on one moves on to the next (only the leader serves; a
standby does not even listen), so the group follows the leader wherever it is.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import grpc
import grpc.aio

from torchheal._base.manager_timeouts import DEFAULT_LIGHTHOUSE_HEARTBEAT_TIMEOUT
from torchheal._wire import methods
from torchheal._wire import session_pb2 as spb
from torchheal._wire import torchft_pb2 as pb
from torchheal.coordination.link_tcp import DirectStream, StreamClosed
from torchheal.coordination.rpc.addresses import parse_address
from torchheal.coordination.rpc.channels import aio_connect, serialize
from torchheal.coordination.rpc.errors import rpc_error_to_exception
from torchheal.coordination.standing import Standing, limit_for

__all__ = ["LighthouseLink", "LinkError", "connect_first", "split_addresses"]

logger: logging.Logger = logging.getLogger(__name__)

# How long a unary heartbeat may take; a lighthouse that slow is as good as unreachable.
HEARTBEAT_CALL_TIMEOUT_S = 2.0
# Reopening a broken session: first pause, growth, cap.
REOPEN_BACKOFF_S = (0.05, 2.0, 2.0)
#: How long a quorum request waits for a session that is reopening before it fails (the
#: caller asks again).
REOPEN_WAIT_S = 1.0
# Asking the lighthouse what it offers, and reaching its direct lane.
DESCRIBE_TIMEOUT_S = 5.0
DIRECT_CONNECT_TIMEOUT_S = 5.0
# A session that has carried no event (answer, notice, heartbeat acknowledgement) for this long
# is taken for dead and reopened: the reference's heartbeat timeout, after which the lighthouse
# has given the group up anyway. Heartbeats ask for an acknowledgement after a quarter of it.
SILENT_SESSION_S = 5.0


# Reaching another lighthouse of the list (a standby that became the leader).
FAILOVER_CONNECT_TIMEOUT_S = 1.0


def split_addresses(addr: str) -> list[str]:
    """The lighthouse addresses in ``addr`` (comma-separated; one for most jobs).

    Args:
        addr: ``http://a:29510`` or ``http://a:29510,http://b:29510``.

    Raises:
        ValueError: no address, or a malformed one.
    """
    addresses = [a.strip() for a in addr.split(",") if a.strip()]
    if not addresses:
        raise ValueError(f"no lighthouse address in {addr!r}")
    for a in addresses:
        parse_address(a)
    return addresses


async def connect_first(
    addresses: Sequence[str], connect_timeout: timedelta | float
) -> tuple[grpc.aio.Channel, str]:
    """A channel to the first of ``addresses`` that answers within ``connect_timeout``.

    All are tried at once (a standby lighthouse does not listen, so waiting on each in turn
    would cost a whole timeout per standby).

    Raises:
        RuntimeError: none answered.
    """
    if len(addresses) == 1:
        return await aio_connect(addresses[0], connect_timeout), addresses[0]
    tasks = {asyncio.ensure_future(aio_connect(a, connect_timeout)): a for a in addresses}
    pending = set(tasks)
    errors = []
    chosen: tuple[grpc.aio.Channel, str] | None = None
    while pending and chosen is None:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            error = task.exception()
            if error is not None:
                errors.append(str(error))
            elif chosen is None:
                chosen = task.result(), tasks[task]
            else:
                await task.result().close()  # a second one answered in the same turn
    for task in pending:
        task.cancel()
    if chosen is None:
        raise RuntimeError(f"no lighthouse of {list(addresses)} could be reached: {errors}")
    return chosen


class LinkError(Exception):
    """A lighthouse request failed; carries the gRPC status the caller should see.

    Args:
        code: the status.
        details: what went wrong.
        local: our own timer gave up (no status came back from the lighthouse).
    """

    def __init__(self, code: grpc.StatusCode, details: str, local: bool = False) -> None:
        super().__init__(details)
        self.code = code
        self.details = details
        self.local = local


class LighthouseLink:
    """The connection of one replica group's manager server to the lighthouse.

    Args:
        channel: an open asyncio channel to the lighthouse.
        replica_id: the group's full id.
        heartbeat_interval_s: pause between heartbeats.
        on_lost: called (on the loop) with each ``MemberLost`` notice the lighthouse sends.
        describe: names the lighthouse in log lines.
        log_prefix: prefixes log lines (``[Replica name]``).
        host: the lighthouse's host, where its direct lane listens (None: the gRPC stream only).
        addresses: every lighthouse of a highly available job, ``describe`` among them (empty:
            one lighthouse). A session that cannot be (re)opened moves on to the next.
        silent_s: a session that carries nothing from the lighthouse for this long is hung up
            and reopened (see :data:`SILENT_SESSION_S`).
        last_quorum_id: the last quorum id the group's store records from an earlier process
            of this group (0: none), told to the lighthouse in the Hello until a quorum comes.
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
    ) -> None:
        if not silent_s > 0:
            raise ValueError(f"silent_s must be > 0, got {silent_s!r}")
        self._silent_s = silent_s
        # Loop time of the live session's latest event (its welcome, at first).
        self._heard_at = 0.0
        self._replica_id = replica_id
        self._interval_s = heartbeat_interval_s
        # What this group saw of its own standing with the lighthouse (standing.py), judged
        # by the default heartbeat timeout until a welcome tells the lighthouse's own. Read
        # from the thread that decides a commit vote, hence the lock.
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
        # The lighthouse's latest quorum id when our first session opened (None: no session):
        # above 0, the job was already running when this group (re)started.
        self.first_welcome_quorum_id: int | None = None
        #: The job was already running when our first session opened (see manager_server).
        self.joined_running = False
        # The last quorum the lighthouse gave us, told to it again in every Hello: a restarted
        # lighthouse must never issue an id that goes backwards or repeats (quorum.restore).
        self._last_quorum: pb.Quorum | None = (
            pb.Quorum(quorum_id=last_quorum_id) if last_quorum_id > 0 else None
        )
        # The id of the quorum whose history the group holds (it last committed or healed in
        # it), told with every request so a lighthouse can tell a history it superseded
        # (quorum.superseded). Any thread.
        self._lineage = 0
        # The steps committed while the group is between two steps (0: in a step), said in the
        # goodbye so that peers still in the step it finished keep their collectives with it.
        self._steps_done = 0
        self._call: Any = None  # the live session stream, or None while it is (re)opening
        self._opened = asyncio.Event()  # set while there is a live session
        self._protocol = 0  # the session protocol of the lighthouse's last welcome
        self._pending: dict[int, asyncio.Future[pb.Quorum]] = {}
        self._ids = itertools.count(1)
        self._closing = False
        # One writer at a time on the stream (heartbeats and requests share it).
        self._write_lock: asyncio.Lock | None = None

    def _bind(self, channel: grpc.aio.Channel, describe: str, host: str | None) -> None:
        """Talk to the lighthouse behind ``channel`` from now on."""
        self._channel = channel
        self._describe = describe
        self._host = host
        self._unary_quorum = channel.unary_unary(
            methods.LIGHTHOUSE_QUORUM.path,
            request_serializer=serialize,
            response_deserializer=pb.LighthouseQuorumResponse.FromString,
        )
        self._unary_heartbeat = channel.unary_unary(
            methods.LIGHTHOUSE_HEARTBEAT.path,
            request_serializer=serialize,
            response_deserializer=pb.LighthouseHeartbeatResponse.FromString,
        )
        self._open_stream = channel.stream_stream(
            methods.LIGHTHOUSE_SESSION.path,
            request_serializer=serialize,
            response_deserializer=spb.SessionEvent.FromString,
        )
        self._describe_call = channel.unary_unary(
            methods.LIGHTHOUSE_DESCRIBE.path,
            request_serializer=serialize,
            response_deserializer=spb.Description.FromString,
        )

    async def _fail_over(self) -> None:
        """Move on to the next lighthouse of the list (a standby may lead now).

        Raises:
            LinkError: it cannot be reached (``UNAVAILABLE``); the next attempt tries the one after.
        """
        addresses = self._addresses
        index = addresses.index(self._describe) if self._describe in addresses else -1
        target = addresses[(index + 1) % len(addresses)]
        try:
            channel = await aio_connect(target, FAILOVER_CONNECT_TIMEOUT_S)
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

    async def _write(self, call: Any, request: spb.SessionRequest) -> None:
        if self._write_lock is None:
            self._write_lock = asyncio.Lock()
        async with self._write_lock:
            await call.write(request)

    # ------------------------------------------------------------------------------------------
    # Life cycle

    async def start(self) -> None:
        """Open the session, or learn that the lighthouse only speaks the reference's protocol.

        Raises:
            LinkError: the lighthouse answers neither a session nor a unary heartbeat.
        """
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
                    pb.LighthouseHeartbeatRequest(replica_id=self._replica_id),
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
                goodbye = spb.Goodbye(reason=reason, steps_done=self._steps_done)
                await self._write(call, spb.SessionRequest(goodbye=goodbye))
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
        """Ask the lighthouse for the next quorum on behalf of the group.

        Args:
            requester: the group's request.
            timeout_s: how long to wait.

        Raises:
            LinkError: the lighthouse refused, the call timed out, or the session broke.
        """
        with self._standing_lock:
            self._standing.asked()
        self._steps_done = 0  # in a step now: a goodbye says nothing of its collectives
        if not self.session_mode:
            return await self._unary_quorum_call(requester, timeout_s)
        call = self._call
        if call is None and not self._closing:
            # A session that broke is reopened at once, in milliseconds when the lighthouse is
            # up (a group woken from a freeze finds its session silent and reopens it just as
            # it asks): wait for that rather than fail and be asked again a retry later.
            try:
                await asyncio.wait_for(self._opened.wait(), min(timeout_s, REOPEN_WAIT_S))
            except asyncio.TimeoutError:
                pass
            call = self._call
        if call is None:
            raise LinkError(grpc.StatusCode.UNAVAILABLE, "the lighthouse session is reopening")
        request_id = next(self._ids)
        future: asyncio.Future[pb.Quorum] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        try:
            await self._write(
                call,
                spb.SessionRequest(
                    quorum=spb.QuorumRequest(
                        request_id=request_id,
                        requester=requester,
                        timeout_ms=max(1, int(timeout_s * 1000)),
                        lineage=self._lineage,
                    )
                ),
            )
            # The lighthouse answers a timed-out request itself; our timer is the backstop.
            quorum = await asyncio.wait_for(asyncio.shield(future), timeout_s + 1.0)
            if self._last_quorum is None or quorum.quorum_id >= self._last_quorum.quorum_id:
                self._last_quorum = quorum
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
            self._pending.pop(request_id, None)

    async def gave_up(self, quorum_id: int, reason: str) -> bool:
        """Tell the lighthouse that the group gave up building quorum ``quorum_id``'s process
        group (``GaveUp``), so that it tells the other groups waiting in that build.

        Best effort: nothing is sent without a live session, or to a lighthouse older than
        session protocol 2 (which would end the session).

        Returns:
            Whether it was sent.
        """
        call = self._call
        if not self.session_mode or call is None or self._protocol < 2:
            return False
        try:
            await self._write(
                call, spb.SessionRequest(gave_up=spb.GaveUp(quorum_id=quorum_id, reason=reason))
            )
        except (grpc.aio.AioRpcError, StreamClosed, RuntimeError) as e:
            logger.info(
                "%s could not tell the lighthouse of the given-up build: %s", self._prefix, e
            )
            return False
        return True

    async def _unary_quorum_call(self, requester: pb.QuorumMember, timeout_s: float) -> pb.Quorum:
        try:
            response = await asyncio.wait_for(
                self._unary_quorum(
                    pb.LighthouseQuorumRequest(requester=requester), timeout=timeout_s
                ),
                timeout_s,
            )
        except asyncio.TimeoutError:
            raise LinkError(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {timeout_s:.3f}s", local=True
            ) from None
        except grpc.aio.AioRpcError as e:
            raise LinkError(e.code(), e.details() or "") from None
        if not response.HasField("quorum"):
            raise LinkError(grpc.StatusCode.INTERNAL, "lighthouse answered without a quorum")
        return response.quorum

    # ------------------------------------------------------------------------------------------
    # The session

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
            raise LinkError(_status(closed.code), closed.message)
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
                code = _status(failed.code)
                self._settle(failed.request_id, error=LinkError(code, failed.message))
            elif kind == "lost":
                if event.lost.replica_id == self._replica_id:
                    self._dropped(event.lost)
                try:
                    self._on_lost(event.lost)
                except Exception:
                    logger.exception("%s handling a lost-member notice failed", self._prefix)

    def holds_last_quorum(self, steps_done: int = 0) -> None:
        """The group holds the history of the last quorum it received: it committed a step in
        it (``steps_done``: the steps committed then), or healed in it from a peer that holds
        it (any thread)."""
        self._steps_done = steps_done  # said in a goodbye until the group asks again
        last = self._last_quorum
        if last is not None and last.participants:
            self._lineage = last.quorum_id

    def doubt(self) -> str | None:
        """Why the lighthouse may have dropped this group since its last quorum request, or
        None (``standing.Standing.doubt``). Any thread."""
        with self._standing_lock:
            return self._standing.doubt(time.monotonic())

    async def _tick(self) -> None:
        """Tell the standing that this loop, which sends the heartbeats, runs (every interval,
        whether or not the lighthouse can be reached: an outage of the lighthouse is not a
        stall of this group)."""
        while True:
            with self._standing_lock:
                gap = self._standing.tick(time.monotonic())
            if gap is not None:
                logger.warning(
                    "%s this process was stalled for %.2fs (its heartbeats with it); the "
                    "lighthouse may have dropped this group, so a step in flight will not commit",
                    self._prefix,
                    gap,
                )
            await asyncio.sleep(self._interval_s)

    def _dropped(self, lost: spb.MemberLost) -> None:
        """The lighthouse says this group is lost (its heartbeat expired while it was frozen),
        or was left out of a newer quorum (``superseded_by``) while it had not asked."""
        last = self._last_quorum
        if last is not None and lost.quorum_id < last.quorum_id:
            return  # about a quorum before the one we now train in
        if lost.superseded_by:
            # Left out of a newer quorum while still at work in this one: a build of it is
            # abandoned (the notice's listeners), nothing else. No doubt of the vote: before
            # this notice the group committed such a step as its peers did, and a doubt made
            # start-ups, where a slow group is often left out once, heal for nothing.
            logger.info(
                "%s the lighthouse issued quorum %d without this group, still in quorum %d",
                self._prefix,
                lost.superseded_by,
                lost.quorum_id,
            )
            return
        if lost.gave_up:
            return  # a rank of ours gave that build up: it votes no, the step cannot commit
        logger.warning(
            "%s the lighthouse dropped this group from quorum %d (%s)",
            self._prefix,
            lost.quorum_id,
            lost.reason,
        )
        with self._standing_lock:
            doubted = self._standing.lost(lost.quorum_id, lost.reason)
        if not doubted:
            logger.info(
                "%s (the notice crossed this group's request for a newer quorum: its vote on the "
                "step of quorum %d was cast before it)",
                self._prefix,
                lost.quorum_id,
            )

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

    # ------------------------------------------------------------------------------------------
    # Reference lighthouse: unary heartbeats

    async def _run_unary_heartbeats(self) -> None:
        # The channel reconnects by itself after a lighthouse restart, so unlike the reference
        # there is no client to rebuild; we only report the outage once and its end once.
        request = pb.LighthouseHeartbeatRequest(replica_id=self._replica_id)
        failing = False
        while not self._closing:
            try:
                await self._unary_heartbeat(request, timeout=HEARTBEAT_CALL_TIMEOUT_S)
                if failing:
                    logger.info("%s heartbeats to the lighthouse work again", self._prefix)
                    failing = False
            except grpc.aio.AioRpcError as e:
                if not failing:
                    logger.warning(
                        "%s heartbeat to lighthouse %s failed: %s",
                        self._prefix,
                        self._describe,
                        rpc_error_to_exception(e, "Heartbeat"),
                    )
                    failing = True
            await asyncio.sleep(self._interval_s)


def _status(code: int) -> grpc.StatusCode:
    for status in grpc.StatusCode:
        if status.value[0] == code:
            return status
    return grpc.StatusCode.UNKNOWN
