"""The lighthouse server: gRPC around the pure quorum decision of ``quorum.py``.

One lighthouse per job collects heartbeats and quorum requests from the replica groups and
issues quorums (reference §4). This module only moves bytes and time: it feeds requests,
heartbeats and ticks into one :class:`~torchheal.coordination.quorum.LighthouseState` held
under a lock, and delivers each issued quorum to the requests waiting for it. Every rule about
*who* is in a quorum lives in ``quorum.py``.

Wire detail: the lighthouse keeps each requester's protobuf ``QuorumMember`` exactly as it
arrived and puts that message in the quorum it sends back, so fields unknown to us (added by a
newer peer) are echoed untouched.

torchheal's manager servers talk to the lighthouse over one long-lived session each
(``lighthouse_session.py``): heartbeats and quorum requests go up, quorums and notices come
down, and the session's end tells the lighthouse at once that the group is gone. When a member of
the current quorum is lost (its session ended, or its heartbeat expired), every session hears a
``MemberLost`` notice, so the other groups can abort a collective they are blocked in with it.
Reference peers keep using the unary ``Heartbeat``/``Quorum``, served unchanged.

Observing: an optional :class:`LighthouseObserver` hears what happens (heartbeats, requests,
issued quorums, expired heartbeats, reason changes) so dashboards and metrics can be built on top
without this module knowing about them (lower layers never import higher ones).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from typing import Any, NamedTuple, Protocol

import grpc
import grpc.aio

from torchheal._wire import methods
from torchheal._wire import session_pb2 as spb
from torchheal._wire import torchft_pb2 as pb
from torchheal._wire.splice import message_field, uint_field
from torchheal.coordination import convert
from torchheal.coordination.lighthouse_session import SessionPeer, session_handler, validated_member
from torchheal.coordination.quorum import (
    LighthouseConfig,
    LighthouseState,
    forget_stale_heartbeats,
    heartbeat,
    join,
    lost_members,
    quorum_compute,
    requeue,
    session_ended,
    session_opened,
    tick,
    withdraw,
)
from torchheal.coordination.rpc.addresses import format_target
from torchheal.coordination.rpc.errors import StatusError
from torchheal.coordination.rpc.server import SERVER_OPTIONS, AioServerThread, unary_handler
from torchheal.coordination.types import Quorum, QuorumMember, Timestamp

__all__ = ["LighthouseObserver", "LighthouseServer"]

logger: logging.Logger = logging.getLogger(__name__)

# Python API defaults (reference §2.4); the CLI has its own (join timeout 60 s).
DEFAULT_JOIN_TIMEOUT_MS = 100
DEFAULT_QUORUM_TICK_MS = 100
DEFAULT_HEARTBEAT_TIMEOUT_MS = 5000

# Heartbeats older than this are dropped so the map stays bounded (the reference keeps them
# forever). At least a minute, so a status view still shows recently departed replicas.
MIN_HEARTBEAT_RETENTION_S = 60.0
PRUNE_INTERVAL_S = 1.0


class LighthouseObserver(Protocol):
    """What the lighthouse tells an observer (a dashboard, metrics). All optional to act on.

    Every method is called on the lighthouse's event-loop thread, some under its state lock, so
    an observer must be quick, must not block and must not call back into the lighthouse. Times
    are ``time.monotonic()`` seconds. Exceptions are logged and otherwise ignored.

    Args:
        replica_id: (of the methods) the replica group's full id.
        member: the requester, as it asked to join.
        quorum: the issued quorum.
        reason: the lighthouse's reason string for its decision.
        round_s: seconds from the round's first request to the issued quorum.
        last_seen: when the expired replica's last heartbeat arrived.
        now: when the lighthouse saw the event.
    """

    def heartbeat(self, replica_id: str) -> None:
        """A heartbeat arrived (the hottest path: count it, do nothing more)."""

    def joined(self, member: QuorumMember, now: float) -> None:
        """A quorum request arrived and joined the round."""

    def quorum_issued(self, quorum: Quorum, reason: str, round_s: float, now: float) -> None:
        """A quorum was issued; ``round_s`` is the time since the round's first request."""

    def expired(self, replica_id: str, last_seen: float, now: float) -> None:
        """A replica's last heartbeat became older than the heartbeat timeout."""

    def reason_changed(self, reason: str, now: float) -> None:
        """The quorum status (the reason string of the latest decision) changed."""

    def lost(self, replica_id: str, reason: str, now: float) -> None:
        """A member of the current quorum is gone (``reason``: why the lighthouse knows)."""


class LighthouseServer:
    """The job's lighthouse: decides which replica groups form each step's quorum.

    Starts serving in the constructor, on a background thread with its own event loop.

    Args:
        bind: address to listen on, e.g. ``"[::]:29510"``; port 0 picks a free port.
        min_replicas: fewest replica groups a new quorum may have (>= 1).
        join_timeout_ms: how long to wait for heartbeating replicas that have not asked to
            join before issuing a quorum without them (None: 100).
        quorum_tick_ms: how often to re-evaluate waiting requests (None: 100).
        heartbeat_timeout_ms: a replica whose last heartbeat is older than this is considered
            gone (None: 5000).
        observer: told about heartbeats, requests, issued quorums, expiries and reason changes
            (see :class:`LighthouseObserver`); None for none.

    Raises:
        ValueError: an option is out of range or ``bind`` is malformed.
        RuntimeError: the address could not be bound.
    """

    def __init__(
        self,
        bind: str,
        min_replicas: int,
        join_timeout_ms: int | None = None,
        quorum_tick_ms: int | None = None,
        heartbeat_timeout_ms: int | None = None,
        observer: LighthouseObserver | None = None,
    ) -> None:
        self._observer = observer
        # When the current round's first request arrived (for the round latency), and which
        # replicas the observer was told expired; both only touched under the lock.
        self._round_started: float | None = None
        self._expired: set[str] = set()
        self._config = LighthouseConfig(
            min_replicas=min_replicas,
            join_timeout_ms=DEFAULT_JOIN_TIMEOUT_MS if join_timeout_ms is None else join_timeout_ms,
            quorum_tick_ms=DEFAULT_QUORUM_TICK_MS if quorum_tick_ms is None else quorum_tick_ms,
            heartbeat_timeout_ms=(
                DEFAULT_HEARTBEAT_TIMEOUT_MS
                if heartbeat_timeout_ms is None
                else heartbeat_timeout_ms
            ),
        )
        self._config.validate()
        self._lock = threading.Lock()
        self._state = LighthouseState()
        # replica_id -> the requester's message as received, for participants of the round.
        self._raw: dict[str, pb.QuorumMember] = {}
        # One queue per waiting Quorum call; only touched on the server loop.
        # Each waiting Quorum call's queue; an issued quorum is delivered to all of them as
        # (quorum id, member ids, serialized response), the response serialized once.
        self._subscribers: set[asyncio.Queue[_Issued]] = set()
        # replica_id -> its live session (loop thread only), and the members of the current
        # quorum already announced lost (quorum id, ids), so each is announced once.
        self._sessions: dict[str, SessionPeer] = {}
        self._announced_lost: tuple[int, set[str]] = (0, set())
        self._tick_scheduled = False
        self._last_reason: str | None = None
        self._last_prune = 0.0
        self._created_at = time.monotonic()
        # A connection that went silent without a FIN (a partition, a frozen host) is ended by
        # HTTP/2 keep-alive pings within about the heartbeat timeout, never sooner: a session
        # must not be more eager to declare a group gone than its heartbeats are.
        keepalive_ms = max(1000, self._config.heartbeat_timeout_ms // 2)
        self._server = AioServerThread(
            "torchheal-lighthouse",
            bind,
            {
                methods.LIGHTHOUSE_SERVICE: {
                    "Quorum": unary_handler(methods.LIGHTHOUSE_QUORUM, self._quorum),
                    "Heartbeat": unary_handler(methods.LIGHTHOUSE_HEARTBEAT, self._heartbeat),
                },
                methods.SESSION_SERVICE: {"Session": session_handler(self)},
            },
            options=[
                *SERVER_OPTIONS,
                ("grpc.keepalive_time_ms", keepalive_ms),
                ("grpc.keepalive_timeout_ms", keepalive_ms),
            ],
        )
        self._server.submit(self._start_ticking()).result()
        logger.info(
            "Lighthouse listening on %s (bound %s) with min_replicas=%d join_timeout_ms=%s "
            "quorum_tick_ms=%s heartbeat_timeout_ms=%s",
            self.address(),
            bind,
            self._config.min_replicas,
            self._config.join_timeout_ms,
            self._config.quorum_tick_ms,
            self._config.heartbeat_timeout_ms,
        )

    # ---------------------------------------------------------------------------------------
    # Public API

    def address(self) -> str:
        """The URL replicas use to reach this lighthouse, ``http://{hostname}:{port}``."""
        return f"http://{format_target(socket.gethostname(), self._server.port)}"

    def port(self) -> int:
        """The TCP port the lighthouse listens on."""
        return self._server.port

    def shutdown(self) -> None:
        """Stop serving; waiting quorum requests are cancelled. Idempotent, thread-safe."""
        self._server.shutdown()

    def status(self) -> dict[str, Any]:
        """A read-only snapshot of the lighthouse, for status views and dashboards.

        Returns:
            A JSON-able dict: ``quorum_id``; ``reason`` (what a quorum computed now would say);
            ``prev_quorum`` (None, or its ``quorum_id``, ``age_s``, ``max_step`` and
            ``participants`` as dicts); ``waiting`` (replica ids with a pending request);
            ``heartbeats`` (replica id -> seconds since last seen); ``config``.
        """
        now = time.monotonic()
        with self._lock:
            _, reason = quorum_compute(self._state, self._config, now)
            prev = self._state.prev_quorum
            heartbeats = {rid: now - seen for rid, seen in self._state.heartbeats.items()}
            waiting = sorted(self._state.participants)
            quorum_id = self._state.quorum_id
        prev_view = None
        if prev is not None:
            prev_view = {
                "quorum_id": prev.quorum_id,
                "age_s": max(0.0, time.time() - prev.created.to_float()),
                "max_step": max((m.step for m in prev.participants), default=-1),
                "participants": [_member_view(m) for m in prev.participants],
            }
        return {
            "quorum_id": quorum_id,
            "reason": reason,
            "prev_quorum": prev_view,
            "waiting": waiting,
            "heartbeats": dict(sorted(heartbeats.items())),
            "config": {
                "min_replicas": self._config.min_replicas,
                "join_timeout_ms": self._config.join_timeout_ms,
                "quorum_tick_ms": self._config.quorum_tick_ms,
                "heartbeat_timeout_ms": self._config.heartbeat_timeout_ms,
            },
        }

    # ---------------------------------------------------------------------------------------
    # Ticks

    async def _start_ticking(self) -> None:
        self._server.spawn(self._tick_loop())

    async def _tick_loop(self) -> None:
        period = self._config.quorum_tick_ms / 1000.0
        while True:
            await asyncio.sleep(period)
            self._tick()
            self._announce_lost("heartbeat expired")
            if self._observer is not None:
                self._report_expired()

    def _announce_lost(self, reason: str) -> None:
        """Tell every session about members of the current quorum that are gone (once each).

        Loop thread only. A member whose session ended is announced at once by
        :meth:`end_session`; this catches the rest on the periodic tick: members whose heartbeat
        expired (a frozen process keeps its session but stops heartbeating) and reference peers.
        """
        now = time.monotonic()
        with self._lock:
            prev = self._state.prev_quorum
            if prev is None:
                return
            lost = lost_members(self._state, self._config, now)
        announced_id, announced = self._announced_lost
        if announced_id != prev.quorum_id:
            announced = set()
            self._announced_lost = (prev.quorum_id, announced)
        for replica_id in lost:
            if replica_id in announced:
                continue
            announced.add(replica_id)
            self._broadcast_lost(replica_id, prev.quorum_id, reason, now)

    def _broadcast_lost(self, replica_id: str, quorum_id: int, reason: str, now: float) -> None:
        logger.warning(
            "Replica %s of quorum %d is lost (%s); telling %d session(s)",
            replica_id,
            quorum_id,
            reason,
            len(self._sessions),
        )
        event = spb.SessionEvent(
            lost=spb.MemberLost(replica_id=replica_id, quorum_id=quorum_id, reason=reason)
        ).SerializeToString()
        for peer in list(self._sessions.values()):
            peer.send(event)
        if self._observer is not None:
            self._notify("lost", replica_id, reason, now)

    def _report_expired(self) -> None:
        """Tell the observer about heartbeats that expired since the last periodic tick."""
        now = time.monotonic()
        timeout_s = self._config.heartbeat_timeout_ms / 1000.0
        with self._lock:
            heartbeats = self._state.heartbeats
            for rid, seen in heartbeats.items():
                if now - seen < timeout_s:
                    self._expired.discard(rid)  # alive (again)
                elif rid not in self._expired:
                    self._expired.add(rid)
                    self._notify("expired", rid, seen, now)
            if self._expired:
                self._expired.intersection_update(heartbeats)  # drop forgotten replicas

    def _notify(self, event: str, *args: Any) -> None:
        # An observer's bug must never take the lighthouse down.
        try:
            getattr(self._observer, event)(*args)
        except Exception:
            logger.exception("lighthouse observer failed on %s", event)

    def _tick(self) -> None:
        """Run one decision and deliver an issued quorum. Called on the server loop only."""
        now = time.monotonic()
        with self._lock:
            quorum, reason = tick(self._state, self._config, now, Timestamp.from_float(time.time()))
            if reason != self._last_reason:
                # Ticks run every 100 ms; repeating an unchanged reason would flood the log.
                logger.info("Quorum status: %s", reason)
                self._last_reason = reason
                if self._observer is not None:
                    self._notify("reason_changed", reason, now)
            if now - self._last_prune >= PRUNE_INTERVAL_S:
                self._last_prune = now
                retention = max(
                    MIN_HEARTBEAT_RETENTION_S, self._config.heartbeat_timeout_ms / 1000.0
                )
                forgotten = forget_stale_heartbeats(self._state, now, retention)
                if forgotten:
                    logger.info("Forgot heartbeats of departed replicas: %s", forgotten)
            if quorum is None:
                return
            round_s = 0.0 if self._round_started is None else now - self._round_started
            self._round_started = None
            raw = self._raw
            # Participants were cleared by tick(); their messages go with the issued quorum.
            self._raw = {}
            subscribers = list(self._subscribers)
        # Serialized once; each waiter's envelope is built around these bytes.
        quorum_bytes = convert.quorum_to_pb(quorum, raw).SerializeToString()
        issued = _Issued(
            quorum.quorum_id,
            frozenset(m.replica_id for m in quorum.participants),
            quorum_bytes,
            message_field(1, quorum_bytes),
        )
        logger.info(
            "Issued quorum %d with %d participants: %s",
            quorum.quorum_id,
            len(quorum.participants),
            [m.replica_id for m in quorum.participants],
        )
        for queue in subscribers:
            queue.put_nowait(issued)
        if self._observer is not None:
            self._notify("quorum_issued", quorum, reason, round_s, now)

    def _schedule_tick(self) -> None:
        """Run one tick after the requests that are ready now have joined.

        Each Quorum request needs a decision right after it joins (reference §4), but running
        the O(N) decision once per request makes a round of N simultaneous requests cost
        O(N^2). Requests that arrive in the same event-loop turn share one tick instead; the
        decision is the one the last of them would have triggered.
        """
        if self._tick_scheduled:
            return
        self._tick_scheduled = True
        asyncio.get_running_loop().call_soon(self._run_scheduled_tick)

    def _run_scheduled_tick(self) -> None:
        self._tick_scheduled = False
        self._tick()

    # ---------------------------------------------------------------------------------------
    # RPCs

    async def _heartbeat(
        self, request: pb.LighthouseHeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> pb.LighthouseHeartbeatResponse:
        if not request.replica_id:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, "missing replica_id")
        self.record_heartbeat(request.replica_id)
        return pb.LighthouseHeartbeatResponse()

    async def _quorum(
        self, request: pb.LighthouseQuorumRequest, context: grpc.aio.ServicerContext
    ) -> bytes:
        if not request.HasField("requester"):
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, "missing requester")
        raw = request.requester
        issued = await self.await_quorum(validated_member(raw), raw)
        return issued.unary_response

    # ---------------------------------------------------------------------------------------
    # What the unary RPCs and the sessions share (loop thread only)

    def record_heartbeat(self, replica_id: str) -> None:
        """A group said it is alive (a unary Heartbeat, or one on its session)."""
        with self._lock:
            heartbeat(self._state, replica_id, time.monotonic())
        observer = self._observer
        if observer is not None:
            try:
                observer.heartbeat(replica_id)
            except Exception:
                logger.exception("lighthouse observer failed on heartbeat")

    def open_session(self, replica_id: str, peer: SessionPeer) -> int:
        """A group opened its session (its Hello); a newer session replaces an older one.

        Returns:
            The latest quorum id, for the group's Welcome.
        """
        self._sessions[replica_id] = peer
        with self._lock:
            session_opened(self._state, replica_id, time.monotonic())
            quorum_id = self._state.quorum_id
        logger.info("Replica %s opened its session", replica_id)
        return quorum_id

    def end_session(self, replica_id: str, peer: SessionPeer, reason: str) -> None:
        """A group's session ended: the group is gone now (unless a newer session replaced it).

        Args:
            replica_id: the group's full id.
            peer: the session that ended.
            reason: why ("connection ended", "left": it said goodbye).
        """
        if self._sessions.get(replica_id) is not peer:
            return  # a newer session of the same group is live; this one was stale
        del self._sessions[replica_id]
        now = time.monotonic()
        with self._lock:
            was_member = session_ended(self._state, replica_id)
            prev = self._state.prev_quorum
        logger.warning("Replica %s is gone: its session ended (%s)", replica_id, reason)
        if was_member and prev is not None:
            announced_id, announced = self._announced_lost
            if announced_id != prev.quorum_id:
                announced = set()
                self._announced_lost = (prev.quorum_id, announced)
            if replica_id not in announced:
                announced.add(replica_id)
                self._broadcast_lost(replica_id, prev.quorum_id, reason, now)
        # The survivors may be complete without it now.
        self._schedule_tick()

    def withdraw(self, member: QuorumMember) -> None:
        """A session's request timed out or was replaced: it no longer waits for a quorum."""
        with self._lock:
            withdraw(self._state, member)

    async def await_quorum(self, member: QuorumMember, raw: pb.QuorumMember) -> _Issued:
        """Join the round with ``member`` and wait for a quorum that includes it.

        Left out of an issued quorum, the request stays for the next one (reference §4).

        Args:
            member: the validated requester.
            raw: its message as received (echoed to keep fields unknown to us).
        """
        queue: asyncio.Queue[_Issued] = asyncio.Queue()
        now = time.monotonic()
        with self._lock:
            join(self._state, member, now)
            self._raw[member.replica_id] = raw
            if self._round_started is None:
                self._round_started = now
            # Subscribe before ticking so the quorum this request completes reaches it.
            self._subscribers.add(queue)
        if self._observer is not None:
            self._notify("joined", member, now)
        try:
            self._schedule_tick()
            while True:
                issued = await queue.get()
                if member.replica_id in issued.member_ids:
                    return issued
                logger.info(
                    "Replica %s not in quorum %d, retrying", member.replica_id, issued.quorum_id
                )
                now = time.monotonic()
                with self._lock:
                    requeue(self._state, member, now)
                    self._raw[member.replica_id] = raw
                    if self._round_started is None:
                        self._round_started = now
        finally:
            with self._lock:
                self._subscribers.discard(queue)


class _Issued(NamedTuple):
    """An issued quorum as its waiters need it."""

    quorum_id: int
    member_ids: frozenset[str]
    quorum: bytes  # the serialized torchft.Quorum
    unary_response: bytes  # a serialized LighthouseQuorumResponse around it

    def session_event(self, request_id: int) -> bytes:
        """The ``SessionEvent`` answering a session's request ``request_id``."""
        issued = uint_field(1, request_id) + message_field(2, self.quorum)
        return message_field(2, issued)


def _member_view(member: QuorumMember) -> dict[str, Any]:
    return {
        "replica_id": member.replica_id,
        "address": member.address,
        "store_address": member.store_address,
        "step": member.step,
        "world_size": member.world_size,
        "shrink_only": member.shrink_only,
        "commit_failures": member.commit_failures,
    }
